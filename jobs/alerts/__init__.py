"""Alerts: per-run rules evaluated as metrics arrive (jobs.ingest.handler calls ``evaluate.on_points``),
on role restarts (jobs.lifecycle.events) and, for "no step for T seconds", by one periodic query
(``tasks.check_silent_runs``). A transition is a run event and, when the run has a webhook, a delivery
(``webhook``). README "Alerts" says what each rule means."""
