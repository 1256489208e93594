"""Fixtures of the security tests (one module per hole closed): the API, ingest and live-UI clients of
the other test folders, shared rather than copied."""

from __future__ import annotations

from tests.api.conftest import api, as_user, mint_token  # noqa: F401
from tests.ingest.conftest import client_for, ingest, other_run  # noqa: F401
from tests.live.conftest import checkpoint_root, cookie_for, flush_layer  # noqa: F401
