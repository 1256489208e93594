"""Every PostgreSQL fast path gives what its portable twin gives (jobs.sql, rlplatform.sql).

Against the PostgreSQL of the test run, each ``<what>_pg`` and ``<what>_portable`` pair is called on the
same data: a read on the same rows, a write on two identical copies of them (then what each stored is
compared too, ids replaced by positions). A ``_pg`` function without a case in ``CASES`` fails
``test_every_fast_path_has_its_twin_and_a_case``: a new fast path cannot skip this check.
"""

from __future__ import annotations

import datetime
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from django.db import connection

from jobs import sql as jobs_sql
from jobs.models import MetricPoint, Run
from jobs.states import RunState
from rlplatform import sql as platform_sql

pytestmark = pytest.mark.django_db

MODULES = {"jobs.sql": jobs_sql, "rlplatform.sql": platform_sql}
T0 = 1_700_000_000.25
KEYS = ["reward", "loss", "never reported"]


class World:
    """Builds the rows a case needs: runs of one experiment, and the personas of tests/conftest.py."""

    def __init__(self, experiment, owner, outsider, superuser, team_a, team_b):
        self.experiment, self.owner, self.outsider, self.superuser = experiment, owner, outsider, superuser
        self.team_a, self.team_b = team_a, team_b
        self._runs = 0

    def run(self, **fields) -> Run:
        self._runs += 1
        values = {"name": f"r{self._runs}", "spec": "{}", "resolved_spec": {}, "devices_requested": 1}
        return Run.objects.create(experiment=self.experiment, rollout_workers=1, **(values | fields))

    def run_with_points(self) -> Run:
        """Attempt 0 at steps 0..9, its steps after 5 rewound, attempt 1 at steps 6..11 (its step 8 twice
        over: one rewound row, one live); values null, absent, negative zero and large ints among them."""
        run = self.run()
        rows = [
            MetricPoint(
                run=run,
                attempt=0,
                step=s,
                time=_time(T0 + s),
                metrics={"reward": s / 3, "loss": None if s == 4 else -s * 1.5} if s != 2 else {"reward": -0.0},
                rewound=s > 5,
            )
            for s in range(10)
        ]
        rows += [
            MetricPoint(run=run, attempt=1, step=s, time=_time(T0 + 100 - s), metrics={"reward": 2**53 + s})
            for s in range(6, 12)
        ]
        rows.append(MetricPoint(run=run, attempt=1, step=8, time=_time(T0), metrics={"loss": 7.0}, rewound=True))
        MetricPoint.objects.bulk_create(rows)
        return run


def _time(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC)


def _plain(table: np.ndarray) -> list[list[float | None]]:
    return [[None if np.isnan(v) else v for v in row] for row in table.tolist()]


def _stored_points(run: Run) -> list[tuple]:
    """The run's metric rows as comparable values: ids replaced by their order of creation."""
    rows = list(
        MetricPoint.objects.filter(run=run).order_by("pk").values_list("attempt", "step", "time", "metrics", "rewound")
    )
    return [(i, *row) for i, row in enumerate(rows)]


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# --- the cases: what each pair is called with, and what must agree ------------------------------------------


def _metric_table(world: World, fn: Callable, run: Run) -> dict:
    tables = {}
    for x in ("step", "time"):
        for include_rewound in (False, True):
            for keys in (KEYS, [], ["loss", "reward", "loss"]):
                table = fn(run.pk, keys, include_rewound, x)
                # The time column is read only for x="time" (the PostgreSQL reader leaves it 0 otherwise).
                tables[x, include_rewound, tuple(keys)] = _plain(table if x == "time" else np.delete(table, 1, 1))
    tables["empty run"] = _plain(fn(world.run().pk, KEYS, True, "time"))
    return tables


def _metric_keys(world: World, fn: Callable, run: Run) -> dict:
    return {"run": fn(run.pk), "empty run": fn(world.run().pk)}


def _upsert_metric_points(world: World, fn: Callable, run: Run) -> dict:
    """A fresh batch, then one replaying some steps with new keys and some without, then a pure replay."""
    first = {1: (T0 + 1, {"a": 1}), 2: (T0 + 2.5, {"a": 2}), 3: (T0 + 3, {"a": 3, "b": None})}
    second = {2: (T0, {"a": 102}), 3: (T0, {"a": 103, "c": -0.5}), 4: (T0 + 4, {"a": 104}), 7: (T0 + 7, {})}
    MetricPoint.objects.create(run=run, attempt=0, step=2, time=_time(T0), metrics={"a": -1}, rewound=True)
    replies = []
    for batch in (first, second, second, {}):
        ids = dict(MetricPoint.objects.filter(run=run).values_list("pk", "step"))
        written = sorted(fn(run.pk, 0, batch), key=lambda r: r[1])
        for row_id, step, *_ in written:
            assert ids.get(row_id, step) == step  # an id is the row of its step: new, or the one merged
        replies.append([(step, time, inserted, _json(after)) for _id, step, time, inserted, after in written])
    return {"replies": replies, "stored": _stored_points(run)}


def _rewind_metric_points(world: World, fn: Callable, run: Run) -> dict:
    return {
        "rewound": [fn(run.pk, 7, 1), fn(run.pk, 3, None), fn(run.pk, 3, None), fn(run.pk, 100, None)],
        "stored": _stored_points(run),
    }


def _mark_admitted(world: World, fn: Callable, runs: list[Run]) -> dict:
    Run.objects.filter(pk=runs[1].pk).update(state=RunState.CANCELLED)
    now = datetime.datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC)
    admitted = fn([runs[2].pk, runs[1].pk, runs[0].pk], now)
    return {"admitted": [[r.pk for r in runs].index(pk) for pk in admitted], "stored": _stored_runs(runs)}


def _write_reasons(world: World, fn: Callable, runs: list[Run]) -> dict:
    fn([(runs[0].pk, "waiting behind an earlier run for free cpu devices"), (runs[2].pk, "quota: 4/4 concurrent runs")])
    fn([])
    return {"stored": _stored_runs(runs)}


def _stored_runs(runs: list[Run]) -> list[tuple]:
    fields = ("state", "reason", "admitted_at")
    return [Run.objects.filter(pk=r.pk).values_list(*fields).get() for r in runs]


def _queued_runs(world: World) -> list[Run]:
    return [world.run(reason="waiting for admission") for _ in range(3)]


def _tokens(world: World) -> list[str]:
    """Prefixes: a member's token, a superuser's outside the team, a token of a user who left the team,
    an unknown prefix."""
    from rlplatform import tokens
    from rlplatform.models import Membership

    prefixes = [tokens.mint(world.owner, world.team_a, "ci")[0].prefix]
    prefixes.append(tokens.mint(world.superuser, world.team_b, "ops")[0].prefix)
    prefixes.append(tokens.mint(world.outsider, world.team_b, "old")[0].prefix)
    Membership.objects.filter(user=world.outsider).delete()
    return [*prefixes, "00000000"]


def _find_token(world: World, fn: Callable, prefixes: list[str]) -> list:
    found = []
    for prefix in prefixes:
        token = fn(prefix)
        if token is None:
            found.append(None)
            continue
        fields = {f.attname: getattr(token, f.attname) for f in token._meta.concrete_fields}
        user = {f.attname: getattr(token.user, f.attname) for f in token.user._meta.concrete_fields}
        found.append((fields, user, token.user_in_team))
    return found


@dataclass(frozen=True)
class Case:
    setup: Callable[[World], Any]  # builds the data; what it returns is handed to ``call``
    call: Callable[[World, Callable, Any], Any]  # calls one of the pair; returns what must agree
    writes: bool  # a write runs each of the pair on its own copy of the data


CASES = {
    "jobs.sql:mark_admitted": Case(_queued_runs, _mark_admitted, writes=True),
    "jobs.sql:write_reasons": Case(_queued_runs, _write_reasons, writes=True),
    "jobs.sql:upsert_metric_points": Case(World.run, _upsert_metric_points, writes=True),
    "jobs.sql:rewind_metric_points": Case(World.run_with_points, _rewind_metric_points, writes=True),
    "jobs.sql:metric_keys": Case(World.run_with_points, _metric_keys, writes=False),
    "jobs.sql:metric_table": Case(World.run_with_points, _metric_table, writes=False),
    "rlplatform.sql:find_token": Case(_tokens, _find_token, writes=False),
}


@pytest.fixture
def world(experiment, owner, outsider, superuser, team_a, team_b):
    return World(experiment, owner, outsider, superuser, team_a, team_b)


@pytest.mark.parametrize("pair", sorted(CASES))
def test_the_postgresql_fast_path_gives_what_its_portable_twin_gives(pair, world):
    if connection.vendor != "postgresql":
        pytest.skip("the _pg half runs on PostgreSQL only")
    module, what = pair.split(":")
    pg, portable = getattr(MODULES[module], f"{what}_pg"), getattr(MODULES[module], f"{what}_portable")
    case = CASES[pair]
    data_pg = case.setup(world)
    data_portable = case.setup(world) if case.writes else data_pg
    assert case.call(world, pg, data_pg) == case.call(world, portable, data_portable)


def test_every_fast_path_has_its_twin_and_a_case():
    for module_name, module in MODULES.items():
        functions = {
            name: fn for name, fn in inspect.getmembers(module, inspect.isfunction) if fn.__module__ == module.__name__
        }
        for name in (n for n in functions if n.endswith("_pg")):
            what = name.removesuffix("_pg")
            assert f"{module_name}:{what}" in CASES, f"{module_name}.{name} has no case in CASES"
            for twin in (f"{what}_portable", what):
                assert twin in functions, f"{module_name}.{name} has no {twin}"
                assert inspect.signature(functions[twin]) == inspect.signature(functions[name]), twin
    for pair in CASES:  # and no case outlives its pair
        module_name, what = pair.split(":")
        assert callable(getattr(MODULES[module_name], f"{what}_pg", None)), f"{pair}: no {what}_pg"
