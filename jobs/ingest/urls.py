"""Routes of the ingest API, mounted at /api/ingest/ (no trailing slashes: the reporter posts to
``/api/ingest/metrics``)."""

from django.urls import path

from jobs.ingest import views

app_name = "ingest"

urlpatterns = [
    path("metrics", views.MetricsView.as_view(), name="metrics"),
    # Events ride in the same body shape (points may be empty); a separate name for clients that send only events.
    path("events", views.MetricsView.as_view(), name="events"),
    path("checkpoints", views.CheckpointView.as_view(), name="checkpoints"),
    path("heartbeat", views.HeartbeatView.as_view(), name="heartbeat"),
    path("command_result", views.CommandResultView.as_view(), name="command-result"),
]
