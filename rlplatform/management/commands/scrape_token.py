"""Mint, list and revoke scrape tokens, the credential of ``/metrics`` (rlplatform.scrape_tokens).

    python manage.py scrape_token mint prometheus --by admin [--days 365]   # prints the token once
    python manage.py scrape_token list
    python manage.py scrape_token revoke <prefix> --by admin

``--by`` names the platform staff member doing it (a staff or superuser account): the audit trail's actor.
"""

from __future__ import annotations

import datetime

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from rlplatform import scrape_tokens
from rlplatform.models import ScrapeToken
from rlplatform.tokens import TokenError


def _staff(username: str):
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise CommandError(f"--by: no user {username!r}")
    if not (user.is_staff or user.is_superuser) or not user.is_active:
        raise CommandError(f"--by: {username} is not active platform staff (is_staff or superuser)")
    return user


class Command(BaseCommand):
    help = "Mint, list or revoke the tokens a Prometheus server scrapes /metrics with (scope metrics:read)."

    def add_arguments(self, parser):
        actions = parser.add_subparsers(dest="action", required=True)
        mint = actions.add_parser("mint", help="a new token, printed once")
        mint.add_argument("name", help="what scrapes with it, e.g. prometheus-prod")
        mint.add_argument("--by", required=True, help="the staff member minting it (audited)")
        mint.add_argument("--days", type=int, default=scrape_tokens.DEFAULT_TTL.days, help="lifetime in days")
        actions.add_parser("list", help="every token with its prefix and state")
        revoke = actions.add_parser("revoke", help="end a token now")
        revoke.add_argument("prefix", help="the token's prefix (the 8 characters after tdp_)")
        revoke.add_argument("--by", required=True, help="the staff member revoking it (audited)")

    def handle(self, *args, action: str, **options):
        if action == "mint":
            user = _staff(options["by"])
            try:
                _token, raw = scrape_tokens.mint(
                    options["name"], created_by=user, ttl=datetime.timedelta(days=options["days"])
                )
            except TokenError as exc:
                raise CommandError(f"{exc.field}: {exc.message}") from None
            self.stdout.write(raw)
        elif action == "list":
            for token in ScrapeToken.objects.all():
                state = "revoked" if token.revoked_at else ("valid" if token.is_valid() else "expired")
                self.stdout.write(f"{token.prefix}  {token.name}  {state}  expires {token.expires_at:%Y-%m-%d}")
        else:
            user = _staff(options["by"])
            token = ScrapeToken.objects.filter(prefix=options["prefix"]).first()
            if token is None:
                raise CommandError(f"prefix: no scrape token {options['prefix']!r}")
            revoked = scrape_tokens.revoke(token, actor=user)
            self.stdout.write(f"revoked {token.prefix}" if revoked else f"{token.prefix} was already revoked")
