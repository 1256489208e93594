"""Run-scoped tokens: minted at launch for one run attempt, stored as a hash, expiring, revocable.

A token reads ``tdr_<prefix>_<secret>``: the prefix (public, unique) finds the
row, the SHA-256 of the whole token must match. As for API tokens
(rlplatform.tokens), the 256-bit secret makes an unsalted hash sufficient.

A run's tokens are revoked when it ends (``REVOKED_AT``, by jobs.handler.transition),
and a token of an ended run is refused even if a row escaped that (minted in a race
with the end). What the ended attempt still had to say stays in its spool, which the
platform stores itself when the role exits (jobs.ingest.spool.replay_spool, no HTTP).
"""

from __future__ import annotations

import datetime
import hmac
import secrets

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from jobs.models import Run, RunToken
from jobs.states import TERMINAL_STATES, RunState
from rlplatform.tokens import hash_token

RUN_TOKEN_PREFIX = "tdr_"
# Long enough for a long run; the launch step mints a fresh token per attempt anyway.
DEFAULT_TTL = datetime.timedelta(days=30)
# The run states that end its tokens. Not PREEMPTED: the run is requeued, and the next attempt drains the
# ended attempt's spool with that attempt's token (runtime.managed.entry.drain_older_spools).
REVOKED_AT = TERMINAL_STATES - {RunState.PREEMPTED}


def _ttl() -> datetime.timedelta:
    days = getattr(settings, "TANDEM_RUN_TOKEN_TTL_DAYS", None)
    return datetime.timedelta(days=days) if days else DEFAULT_TTL


def mint_run_token(run: Run, attempt: int, *, ttl: datetime.timedelta | None = None) -> str:
    """Create a token for ``run``'s ``attempt`` and return its plaintext (shown once, never stored)."""
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"attempt must be a non-negative integer, got {attempt!r}")
    ttl = ttl if ttl is not None else _ttl()
    if ttl <= datetime.timedelta(0):
        raise ValueError("ttl must be positive")
    now = timezone.now()
    for _draw in range(5):
        prefix = secrets.token_hex(4)
        raw = f"{RUN_TOKEN_PREFIX}{prefix}_{secrets.token_urlsafe(32)}"
        try:
            with transaction.atomic():
                RunToken.objects.create(
                    run=run,
                    attempt=attempt,
                    prefix=prefix,
                    token_hash=hash_token(raw),
                    created_at=now,
                    expires_at=now + ttl,
                )
            return raw
        except IntegrityError:
            continue  # prefix collision: draw again
    raise RuntimeError("could not allocate a unique run token prefix")


def revoke_run_tokens(run: Run, attempt: int | None = None) -> int:
    """Revoke the run's live tokens (of one attempt, or all); returns how many."""
    live = RunToken.objects.filter(run=run, revoked_at__isnull=True)
    if attempt is not None:
        live = live.filter(attempt=attempt)
    return live.update(revoked_at=timezone.now())


def authenticate_run_token(raw: str) -> RunToken | None:
    """The valid token for ``raw``, or None (unknown, wrong secret, revoked, expired, or its run ended)."""
    if not raw or not raw.startswith(RUN_TOKEN_PREFIX):
        return None
    prefix, sep, secret = raw[len(RUN_TOKEN_PREFIX) :].partition("_")
    if not sep or len(prefix) != 8 or not secret:
        return None
    # The run's experiment comes along: ingest tells the run's team about new metrics (jobs.stream).
    token = RunToken.objects.select_related("run__experiment").filter(prefix=prefix).first()
    if token is None or not hmac.compare_digest(token.token_hash, hash_token(raw)):
        return None
    if token.revoked_at is not None or token.expires_at <= timezone.now():
        return None
    if token.run.state in REVOKED_AT:  # loaded with the token: no extra query
        return None
    return token
