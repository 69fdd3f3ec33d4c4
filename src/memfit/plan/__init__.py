"""memfit.plan."""
