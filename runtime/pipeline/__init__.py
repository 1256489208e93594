"""The pipeline: the driver of a run (RunContext, run) and its modes (inline: sync and colocated; async)."""
