"""memfit.report."""
