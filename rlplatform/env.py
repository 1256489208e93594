"""Typed readers for environment variables that fail loudly.

Every setting the operator can change comes through one of these, so a typo
such as ``DEBUG=ture`` stops start-up with a message naming the variable
instead of silently meaning something else. Unset (or empty) variables give
the default.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qsl, unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def env_str(name: str, default: str | None = None, *, required: bool = False) -> str | None:
    value = _raw(name)
    if value is None:
        if required:
            raise ImproperlyConfigured(f"environment variable {name} is required")
        return default
    return value


def env_bool(name: str, default: bool) -> bool:
    value = _raw(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"environment variable {name}={value!r} is not a boolean (use true/false, 1/0, yes/no)")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise ImproperlyConfigured(f"environment variable {name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"environment variable {name}={number} is below the minimum {minimum}")
    if maximum is not None and number > maximum:
        raise ImproperlyConfigured(f"environment variable {name}={number} is above the maximum {maximum}")
    return number


def env_float(name: str, default: float | None, *, minimum: float | None = None) -> float | None:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfigured(f"environment variable {name}={value!r} is not a number") from None
    if minimum is not None and number < minimum:
        raise ImproperlyConfigured(f"environment variable {name}={number} is below the minimum {minimum}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    """Comma-separated list; surrounding spaces and empty items are dropped."""
    value = _raw(name)
    if value is None:
        return list(default)
    return [item.strip() for item in value.split(",") if item.strip()]


def parse_database_url(url: str, *, name: str = "DATABASE_URL") -> dict:
    """Django DATABASES entry for ``postgres://user:pass@host:port/db?opt=v`` or ``sqlite:///path``.

    Query parameters become connection OPTIONS (e.g. ``sslmode=require``).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("postgres", "postgresql", "pgsql"):
        database = unquote(parts.path.lstrip("/"))
        if not database:
            raise ImproperlyConfigured(f"{name} names no database (expected postgres://user:pass@host:port/dbname)")
        try:
            port = parts.port
        except ValueError:
            raise ImproperlyConfigured(f"{name} has an invalid port") from None
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": database,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": unquote(parts.hostname or ""),
            "PORT": str(port or ""),
            "OPTIONS": dict(parse_qsl(parts.query)),
        }
    if scheme == "sqlite":
        # sqlite:///relative.sqlite3 or sqlite:////absolute/path.sqlite3 (the usual convention).
        path = unquote(parts.path[1:])
        if not path:
            raise ImproperlyConfigured(f"{name} names no SQLite file (expected sqlite:////absolute/path.sqlite3)")
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": path}
    raise ImproperlyConfigured(f"{name} has unsupported scheme {parts.scheme!r} (use postgres:// or sqlite://)")
