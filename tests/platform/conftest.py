"""Fixtures of the platform tests (personas and groups live in tests/conftest.py)."""

import pytest


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # Personas are created with passwords; PBKDF2 costs about a second per user on a loaded 2-core machine.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
