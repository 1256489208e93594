"""Replaying an ended attempt's spool: what its reporter could not deliver (the platform was unreachable
when it exited) lies in the run directory, and the platform stores it itself, without HTTP.

Only the trainer reports through a spool (rollout roles send heartbeats alone). The records go in as the
ingest API would take them, with the attempt's newest run token (even one revoked since: the run may have
ended), so a replay is idempotent like any other.
"""

from __future__ import annotations

import logging
from pathlib import Path

from jobs.ingest import handler as ingest
from jobs.models import RunRole, RunToken
from runtime.contract import TRAINER_ROLE, batch_body, spool_dir, undelivered

logger = logging.getLogger(__name__)

SPOOL_REPLAY_BATCH = 500  # records per stored batch


def replay_spool(role_id: int, attempt: int) -> int:
    """Store what the ended ``attempt`` of the role left undelivered in its spool; returns the records read."""
    role = RunRole.objects.filter(pk=role_id).values("run_id", "name", "workdir").first()
    if role is None or role["name"] != TRAINER_ROLE:
        return 0
    records = undelivered(spool_dir(Path(role["workdir"]), attempt))
    token = (
        RunToken.objects.filter(run_id=role["run_id"], attempt=attempt).order_by("-created_at").first()
        if records
        else None
    )
    if token is None:
        return 0
    run_id = role["run_id"]
    for start in range(0, len(records), SPOOL_REPLAY_BATCH):
        body = batch_body(records[start : start + SPOOL_REPLAY_BATCH], str(run_id), attempt, role["name"])
        try:
            ingest.ingest_batch(token, body, deliver_commands=False)
        except ingest.InvalidInput as exc:  # a record the API refuses: the rest still goes in
            logger.warning("run %s attempt %s: spooled batch refused: %s", run_id, attempt, exc)
    return len(records)
