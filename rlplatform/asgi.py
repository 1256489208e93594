"""ASGI entry point: HTTP through Django, WebSockets (the live UI, jobs.routing) through Channels.

The run-status read CI polls (``GET /api/runs/{id}/`` with an API token) is
answered by jobs.api.views.RunStatusFastPath in front of Django, with the same
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
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from jobs.api.views import RunStatusFastPath  # noqa: E402
from jobs.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": RunStatusFastPath(django_asgi_app),
        "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
    }
)
