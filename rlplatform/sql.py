"""The rlplatform app's PostgreSQL fast paths, each beside its portable twin.

As in jobs.sql: ``<what>_pg`` (hand-written SQL, PostgreSQL only) and ``<what>_portable`` (the ORM, any
database) have one signature and give the same result; ``<what>(...)`` picks by the connection's vendor.
tests/platform/test_sql_pairs.py runs every pair on the same data against PostgreSQL.
"""

from __future__ import annotations

from functools import cache

from django.contrib.auth import get_user_model
from django.db import connection
from django.db.models import Exists, OuterRef

from rlplatform.models import APIToken, Membership


def find_token(prefix: str) -> APIToken | None:
    """The API token with this prefix, its ``user`` loaded, and ``user_in_team``: whether the user is a
    member of the token's team; None when there is none. One query (the token check of every API call)."""
    return find_token_pg(prefix) if connection.vendor == "postgresql" else find_token_portable(prefix)


# The query written out: building it through the ORM (token, user, and an EXISTS on the membership) cost about
# 2 ms of CPU on the 2-core dev machine, four times the run-status read it guards. Not used elsewhere: SQLite
# hands back naive datetimes that the ORM would convert.


@cache
def _token_query() -> tuple[str, list, list]:
    """(SQL, token fields, user fields): a token by prefix, its user, and whether the user is in its team."""
    q = connection.ops.quote_name
    user_model = get_user_model()
    token_fields, user_fields = list(APIToken._meta.concrete_fields), list(user_model._meta.concrete_fields)
    member = Membership._meta
    columns = [f"t.{q(f.column)}" for f in token_fields] + [f"u.{q(f.column)}" for f in user_fields]
    sql = (
        f"SELECT {', '.join(columns)}, EXISTS (SELECT 1 FROM {q(member.db_table)} m "
        f"WHERE m.{q('team_id')} = t.{q('team_id')} AND m.{q('user_id')} = t.{q('user_id')}) "
        f"FROM {q(APIToken._meta.db_table)} t "
        f"JOIN {q(user_model._meta.db_table)} u ON u.{q(user_model._meta.pk.column)} = t.{q('user_id')} "
        f"WHERE t.{q('prefix')} = %s"
    )
    return sql, token_fields, user_fields


def find_token_pg(prefix: str) -> APIToken | None:
    sql, token_fields, user_fields = _token_query()
    with connection.cursor() as cursor:
        cursor.execute(sql, [prefix])
        row = cursor.fetchone()
    if row is None:
        return None
    n = len(token_fields)
    token = APIToken.from_db(connection.alias, [f.attname for f in token_fields], row[:n])
    token.user = get_user_model().from_db(connection.alias, [f.attname for f in user_fields], row[n:-1])
    token.user_in_team = row[-1]
    return token


def find_token_portable(prefix: str) -> APIToken | None:
    membership = Membership.objects.filter(team_id=OuterRef("team_id"), user_id=OuterRef("user_id"))
    tokens = APIToken.objects.select_related("user").annotate(user_in_team=Exists(membership))
    return tokens.filter(prefix=prefix).first()
