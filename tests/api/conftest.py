"""Fixtures of the API tests: an API client and tokens for the personas of tests/conftest.py."""

from __future__ import annotations

import pytest


@pytest.fixture
def api():
    from rest_framework.test import APIClient

    return APIClient()


@pytest.fixture
def mint_token(db):
    """mint_token(user, team, **kwargs) -> plaintext token (through rlplatform.tokens)."""
    from rlplatform import tokens

    def mint(user, team, name="ci", **kwargs):
        _token, raw = tokens.mint(user, team, name, **kwargs)
        return raw

    return mint


@pytest.fixture
def as_user(mint_token):
    """as_user(user, team) -> an APIClient authenticated by a fresh token of ``user`` in ``team``."""
    from rest_framework.test import APIClient

    def client(user, team):
        c = APIClient()
        c.credentials(HTTP_AUTHORIZATION=f"Bearer {mint_token(user, team)}")
        return c

    return client
