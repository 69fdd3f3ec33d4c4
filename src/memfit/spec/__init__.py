"""What a run is made of, as facts: the model spec, the resolved run, the optimizer, loss and linear tables, engines."""
