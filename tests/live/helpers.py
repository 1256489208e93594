"""Helpers of the live-UI tests."""

from __future__ import annotations

import functools
import importlib.util
import sys
import types

ORIGIN = b"http://testserver"


async def receive_until_live(comm, timeout: float = 5) -> tuple[list[dict], dict]:
    """Messages up to and including the ``live`` marker: (entries, marker)."""
    entries = []
    while True:
        message = await comm.receive_json_from(timeout=timeout)
        if message.get("type") == "live":
            return entries, message
        entries.append(message)


@functools.cache
def _websocket_communicator_class():
    """channels.testing.WebsocketCommunicator. The package's __init__ also imports its live-server test
    case, which needs daphne (and Twisted); without daphne installed, load the package's modules alone."""
    try:
        from channels.testing import WebsocketCommunicator
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("daphne"):
            raise
        sys.modules.pop("channels.testing", None)
        package = types.ModuleType("channels.testing")
        channels_dir = importlib.util.find_spec("channels").submodule_search_locations[0]
        package.__path__ = [f"{channels_dir}/testing"]
        sys.modules["channels.testing"] = package
        from channels.testing.websocket import WebsocketCommunicator
    return WebsocketCommunicator


def communicator(path: str, cookie: str | None = None, origin: bytes = ORIGIN):
    """A WebsocketCommunicator on the real ASGI application."""
    from rlplatform.asgi import application

    WebsocketCommunicator = _websocket_communicator_class()

    headers = [(b"origin", origin), (b"host", b"testserver")]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    return WebsocketCommunicator(application, path, headers=headers)
