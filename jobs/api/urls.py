"""Routes of the jobs API; rlplatform.urls mounts them under /api/."""

from rest_framework.routers import SimpleRouter

from jobs.api import alerts, live, views

router = SimpleRouter()
router.register("experiments", views.ExperimentViewSet, basename="experiment")
router.register("runs", views.RunViewSet, basename="run")
router.register("quotas", views.QuotaViewSet, basename="quota")
# Live UI (jobs.api.live): nested under a run, the run id in the prefix.
router.register(r"runs/(?P<run_id>[0-9]+)/metrics", live.RunMetricsViewSet, basename="run-metrics")
router.register(r"runs/(?P<run_id>[0-9]+)/commands", live.RunCommandsViewSet, basename="run-commands")
router.register(r"runs/(?P<run_id>[0-9]+)/checkpoints", live.RunCheckpointsViewSet, basename="run-checkpoints")
router.register(r"runs/(?P<run_id>[0-9]+)/roles", live.RunRolesViewSet, basename="run-roles")
router.register(r"runs/(?P<run_id>[0-9]+)/events", live.RunEventsViewSet, basename="run-events")
router.register(r"runs/(?P<run_id>[0-9]+)/config-versions", live.RunConfigVersionsViewSet, basename="run-configs")
router.register(r"runs/(?P<run_id>[0-9]+)/alerts", alerts.RunAlertsViewSet, basename="run-alerts")
router.register("checkpoints", live.CheckpointViewSet, basename="checkpoint")

urlpatterns = router.urls
