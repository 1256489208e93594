"""Root URLconf: admin, the REST API under /api/, its schema and docs, login, /metrics, and the pages."""

import mimetypes
import posixpath
from pathlib import Path

from django.conf import settings
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.contrib.staticfiles import finders
from django.http import Http404, HttpResponse
from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import SimpleRouter

from jobs import views as pages
from jobs.api.urls import router as jobs_router
from jobs.metrics.view import metrics_view
from rlplatform import api
from rlplatform.login_throttle import ThrottledLoginForm

router = SimpleRouter()
router.register("teams", api.TeamViewSet, basename="team")
router.register("resource-groups", api.ResourceGroupViewSet, basename="resourcegroup")
router.register("hosts", api.HostViewSet, basename="host")
router.register("devices", api.DeviceViewSet, basename="device")
router.register("tokens", api.TokenViewSet, basename="token")
router.register("audit", api.AuditLogViewSet, basename="audit")
router.registry.extend(jobs_router.registry)

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),
    path("api/docs/", pages.api_docs, name="api-docs"),
    path("api/ingest/", include("jobs.ingest.urls")),
    path("api/", include(router.urls)),
    path("login/", auth_views.LoginView.as_view(authentication_form=ThrottledLoginForm), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("metrics", metrics_view, name="metrics"),  # Prometheus, with a scrape token (jobs/metrics/view.py)
    path("", include("jobs.urls")),
]


def serve_static(request, path: str) -> HttpResponse:
    """One static file found by the staticfiles finders (a path escaping them is a 400)."""
    found = finders.find(posixpath.normpath(path).lstrip("/"))
    if not found or not Path(found).is_file():
        raise Http404(path)
    content_type, _encoding = mimetypes.guess_type(found)
    # Read whole: the files are small, and a plain response avoids ASGI's sync-iterator warning.
    response = HttpResponse(Path(found).read_bytes(), content_type=content_type or "application/octet-stream")
    response["Cache-Control"] = "max-age=300"
    return response


# The pages' few static files (CSS, later the UI's JS), served by Django itself
# so the one-machine demo under uvicorn works without a proxy (Django serves
# static files on its own only under runserver with DEBUG). A deployment whose
# proxy serves STATIC_ROOT (after collectstatic) never reaches this route.
if not settings.STATIC_URL.startswith(("http://", "https://", "//")):
    urlpatterns.append(re_path(rf"^{settings.STATIC_URL.strip('/')}/(?P<path>.*)$", serve_static))
