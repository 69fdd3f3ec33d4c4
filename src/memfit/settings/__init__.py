"""The settings of a run: the schema, its typed configuration, validation and derived defaults."""
