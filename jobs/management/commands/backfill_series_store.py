"""``manage.py backfill_series_store [--run ID ...]``: put runs whose metric rows predate the chart-data store
into it (jobs.series_store). Idempotent; safe while the runs ingest (each run is one transaction, serialised with
its ingest). Until a run is backfilled its charts are read from the JSON rows, with the same answers, slower."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.db.models import Exists, OuterRef

from jobs import series_store
from jobs.models import MetricPoint, Run, SeriesStore


class Command(BaseCommand):
    help = "Put runs with metric rows from before the chart-data store into it."

    def add_arguments(self, parser):
        parser.add_argument("--run", type=int, action="append", default=[], help="Only this run id (repeatable)")

    def handle(self, *args, run: list[int], **options):
        if connection.vendor != "postgresql":
            raise CommandError("the chart-data store is PostgreSQL-only; other databases read the JSON rows")
        missing = Run.objects.filter(Exists(MetricPoint.objects.filter(run=OuterRef("pk")))).exclude(
            pk__in=SeriesStore.objects.values("run_id")
        )
        if run:
            missing = missing.filter(pk__in=run)
        run_ids = list(missing.order_by("pk").values_list("pk", flat=True))
        for run_id in run_ids:
            rows = series_store.backfill(run_id)
            if rows is not None:
                self.stdout.write(f"run {run_id}: {rows} metric rows packed")
        self.stdout.write(f"{len(run_ids)} run(s) backfilled")
