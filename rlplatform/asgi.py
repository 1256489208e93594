"""ASGI entry point: HTTP through Django; WebSockets join here when the live UI lands."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "rlplatform.settings")

# Django must be set up before anything imports models (consumers will).
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

application = ProtocolTypeRouter({"http": django_asgi_app})
