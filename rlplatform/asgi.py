"""ASGI entry point: HTTP through Django, WebSockets (the live UI, jobs.routing) through Channels.

The run-status read CI polls (``GET /api/runs/{id}/`` with an API token) is
answered by jobs.api.fast_status.RunStatusFastPath in front of Django, with the same
checks and the same reply at a quarter of the CPU (docs/performance.md);
anything else it passes to Django.

WebSockets are authenticated by the Django session (AuthMiddlewareStack) and
only accepted from origins in ALLOWED_HOSTS, so another site cannot open one
with the user's cookie.
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "rlplatform.settings")

# Django must be set up before anything imports models (the consumers do).
django_asgi_app = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import OriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402

from jobs.api.fast_status import RunStatusFastPath  # noqa: E402
from jobs.metrics.process_exit import lifespan  # noqa: E402
from jobs.routing import websocket_urlpatterns  # noqa: E402


class AllowedHostsOrigins(OriginValidator):
    """WebSockets only from origins in ALLOWED_HOSTS, read at each handshake: channels' own
    AllowedHostsOriginValidator keeps the list it saw at import, so a process whose settings change
    afterwards (the test environment adds its host) would check a stale one."""

    def __init__(self, application):
        super().__init__(application, [])

    def valid_origin(self, parsed_origin):
        hosts = settings.ALLOWED_HOSTS
        self.allowed_origins = hosts or (["localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
        return super().valid_origin(parsed_origin)


application = ProtocolTypeRouter(
    {
        "http": RunStatusFastPath(django_asgi_app),
        "websocket": AllowedHostsOrigins(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
        "lifespan": lifespan,  # a worker's shutdown marks it dead for /metrics' multiprocess files
    }
)
