"""The ingest API for the runtime: metric batches, events, checkpoints, heartbeats, command results.

Role processes authenticate with a run-scoped token (``tokens.py``); ``handler.py``
holds the logic, ``views.py`` only parses and maps errors. See docs/ingest-and-commands.md.
"""
