"""Runs of experiments: models, state machine, admission, handler, tasks, API. Kept import-free: jobs.client runs without Django."""
