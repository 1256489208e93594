"""Fixtures of the live-UI tests: a RUNNING run of team A, session cookies, WebSocket helpers.

The WebSocket tests drive the real ASGI application (rlplatform.asgi) through
``WebsocketCommunicator``; with ``REDIS_URL`` set the channel layer is Redis.
They need committed data (consumers read in other threads), hence
``transactional_db``; the REST tests use the plain ``db``.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def cookie_for(db):
    """cookie_for(user) -> the Cookie header value of a fresh session of that user."""
    from django.conf import settings
    from django.test import Client

    def make(user):
        client = Client()
        client.force_login(user)
        return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"

    return make


@pytest.fixture
def checkpoint_root(tmp_path, settings):
    root = tmp_path / "ckpt-root"
    root.mkdir()
    settings.TANDEM_CHECKPOINT_ROOT = root
    return root


@pytest.fixture
def flush_layer():
    """Start each WebSocket test with an empty channel layer (Redis keeps groups between tests)."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if hasattr(layer, "flush"):
        async_to_sync(layer.flush)()
    yield layer
    if hasattr(layer, "flush"):
        async_to_sync(layer.flush)()
