"""memfit.corpus."""
