"""Shipped data: architecture presets and the GPU table."""
