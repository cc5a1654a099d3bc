"""Compatibility with Transformer Engine itself: reading its checkpoints, and (opt-in) standing
in for the `transformer_engine` package so unmodified TE code runs on te-core."""
