"""memfit's seams with other libraries: transformers/PEFT compatibility, the Hub, versions, trackers, bitsandbytes."""
