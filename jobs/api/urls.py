"""Routes of the jobs API; rlplatform.urls mounts them under /api/."""

from rest_framework.routers import SimpleRouter

from jobs.api import views

router = SimpleRouter()
router.register("experiments", views.ExperimentViewSet, basename="experiment")
router.register("runs", views.RunViewSet, basename="run")
router.register("quotas", views.QuotaViewSet, basename="quota")

urlpatterns = router.urls
