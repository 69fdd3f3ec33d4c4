"""Building what a run runs (model, LoRA, parameter groups, optimizer), shared by the trace and training."""
