"""Empty /metrics' multiprocess directory (settings.TANDEM_PROMETHEUS_DIR): run at service start, before
the web server and the workers of this machine start.

    python manage.py reset_metrics_dir

The files of processes from an earlier start would otherwise be summed into every scrape for ever, and a
new process with a reused pid would add to a dead one's file. Prometheus reads the drop as a counter reset.
"""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand

from jobs import metrics


class Command(BaseCommand):
    help = "Delete the Prometheus multiprocess files of earlier processes (at service start only)."

    def handle(self, *args, **options):
        directory = Path(metrics.metrics_dir())
        removed = 0
        for path in directory.glob("*.db"):
            path.unlink(missing_ok=True)
            removed += 1
        self.stdout.write(f"removed {removed} file(s) from {directory}")
