"""Login throttling: too many wrong passwords lock further attempts for a while.

Failures are counted per username and per client address in the cache (Redis when ``REDIS_URL`` is
set, so every web process shares the counts; the local-memory cache of one process otherwise). A
counter lives ``TANDEM_LOGIN_LOCKOUT_S`` from its first failure; once it reaches its limit
(``TANDEM_LOGIN_MAX_FAILURES`` for a username, ``TANDEM_LOGIN_MAX_FAILURES_PER_ADDRESS`` for an
address) every attempt it covers is refused, the right password too, until ``TANDEM_LOGIN_LOCKOUT_S``
after the failure that reached the limit. A successful login clears its username's count.

The check sits in the authentication backend, so every place that takes a password (the login page,
the admin's login) is throttled; the login page's form also says why it refused.
"""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.forms import AuthenticationForm
from django.core.cache import cache
from django.core.exceptions import PermissionDenied, ValidationError


class LoginLocked(PermissionDenied):
    """Attempts for this username or from this address are locked for now."""


def locked_message() -> str:
    minutes = max(1, round(settings.TANDEM_LOGIN_LOCKOUT_S / 60))
    return (
        "Too many failed logins for this account or from this address: logging in is locked"
        f" for {minutes} minute{'s' if minutes != 1 else ''}. Try again later."
    )


def client_address(request) -> str:
    """The peer's address as the server saw it (behind a proxy: what uvicorn's --proxy-headers set)."""
    return (request.META.get("REMOTE_ADDR") if request is not None else None) or "unknown"


def _counters(username: str | None, address: str) -> list[tuple[str, int]]:
    """(cache key, limit) of each counter an attempt touches; usernames hashed (any length, any character)."""
    counters = [(f"login-failures:address:{address}", settings.TANDEM_LOGIN_MAX_FAILURES_PER_ADDRESS)]
    if username:
        digest = hashlib.sha256(username.casefold().encode()).hexdigest()
        counters.append((f"login-failures:user:{digest}", settings.TANDEM_LOGIN_MAX_FAILURES))
    return counters


def is_locked(username: str | None, address: str) -> bool:
    counters = _counters(username, address)
    counts = cache.get_many([key for key, _limit in counters])
    return any(counts.get(key, 0) >= limit for key, limit in counters)


def record_failure(username: str | None, address: str) -> None:
    lockout = settings.TANDEM_LOGIN_LOCKOUT_S
    for key, limit in _counters(username, address):
        cache.add(key, 0, timeout=lockout)  # the window starts at the first failure
        try:
            count = cache.incr(key)  # atomic in Redis: concurrent failures all count
        except ValueError:  # expired between add and incr: this failure starts a new window
            cache.add(key, 1, timeout=lockout)
            count = 1
        if count >= limit:
            cache.touch(key, lockout)  # locked for the full lockout from the failure that reached the limit


def record_success(username: str) -> None:
    cache.delete_many([key for key, _limit in _counters(username, "")[1:]])


def clear(username: str | None = None, address: str | None = None) -> None:
    """Forget the counts of ``username`` and ``address`` (an operator unlocking an account, or a test)."""
    keys = [key for key, _limit in _counters(username, address or "")]
    if address is None:
        keys = keys[1:]
    cache.delete_many(keys)


class ThrottledModelBackend(ModelBackend):
    """Django's username/password backend with the throttle in front of it."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None:
            username = kwargs.get(get_user_model().USERNAME_FIELD)
        if username is None or password is None:
            return None
        address = client_address(request)
        if is_locked(username, address):
            raise LoginLocked(locked_message())  # django.contrib.auth.authenticate stops at this backend
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is None:
            record_failure(username, address)
        else:
            record_success(username)
        return user


class ThrottledLoginForm(AuthenticationForm):
    """The login page's form: says that logging in is locked rather than that the password was wrong."""

    def clean(self):
        username = self.cleaned_data.get("username")
        address = client_address(self.request)
        if username and is_locked(username, address):
            raise ValidationError(locked_message(), code="locked")
        try:
            return super().clean()
        except ValidationError:
            if username and is_locked(username, address):  # this failure reached the limit
                raise ValidationError(locked_message(), code="locked") from None
            raise
