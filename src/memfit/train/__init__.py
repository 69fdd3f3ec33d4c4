"""memfit.train."""
