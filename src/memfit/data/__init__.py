"""Training data: sources and formats read, tokenized, packed and cached for a run."""
