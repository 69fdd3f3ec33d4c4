"""memfit.data.corpus: the demo corpus (scripts/make_corpus.py makes it) and its preference pairs."""
