"""A run's live parameters over time: the one computation of config-version diffs.

Entry 0 holds the resolved spec's values of the live parameters
(jobs.commands.live_params); then one entry per config version, with what it
set, the parameters in force after it, and its diff against those in force
before it. A change whose command failed never took effect (as in
jobs.commands.effective_params): it is listed, and later diffs ignore it.
The REST API (jobs.api.live) and the run page (jobs.views) both show this.
"""

from __future__ import annotations

from typing import Any

from jobs import commands
from jobs.models import CommandState, ConfigVersion, Run
from runtime.spec import resolved_value

INITIAL = "initial"  # the state of entry 0


def config_history(run: Run) -> list[dict[str, Any]]:
    """``[{number, params, effective, diff: {param: {before, after}}, state, ...}]``, oldest first.

    Entries of versions also carry ``created_by`` (a username or None) and ``created_at``."""
    base = {key: resolved_value(run.resolved_spec, key) for key in commands.live_params(run)}
    current = dict(base)
    history = [{"number": 0, "params": {}, "effective": dict(base), "diff": {}, "state": INITIAL}]
    versions = ConfigVersion.objects.filter(run=run).select_related("command", "created_by").order_by("number")
    for version in versions:
        state = version.command.state if version.command else CommandState.DONE.value
        after = {**current, **version.params}
        diff = {k: {"before": current.get(k), "after": v} for k, v in after.items() if current.get(k) != v}
        history.append(
            {
                "number": version.number,
                "params": version.params,
                "effective": after,
                "diff": diff,
                "state": state,
                "created_by": version.created_by.get_username() if version.created_by else None,
                "created_at": version.created_at,
            }
        )
        if state != CommandState.FAILED:
            current = after
    return history
