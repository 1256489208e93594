"""Submit the demo RL run as the demo user (after ``demo_setup``): idempotent by submission id.

    python manage.py demo_submit examples/demo.yaml model.path=$PWD/var/models/demo-sft-30

Prints the run's page URL. Running it again returns the run it submitted before.
"""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from jobs import handler
from jobs.models import Experiment
from rlplatform.management.commands.demo_setup import DEMO_USER

SUBMISSION_ID = "demo"


class Command(BaseCommand):
    help = "Submit the demo RL run (spec file plus key.sub=value overrides) to the demo experiment."

    def add_arguments(self, parser):
        parser.add_argument("spec", help="spec file")
        parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
        parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="where the web UI is served")

    def handle(self, *args, spec: str, overrides: list[str], base_url: str, **options):
        user = get_user_model().objects.filter(username=DEMO_USER).first()
        experiment = Experiment.objects.filter(name="demo", team__name="demo").first()
        if user is None or experiment is None:
            raise CommandError("run `python manage.py demo_setup` first")
        try:
            with open(spec) as fh:
                text = fh.read()
        except OSError as exc:
            raise CommandError(f"spec: cannot read {spec}: {exc}") from None
        try:
            run, created = handler.submit_run(user, experiment, text, overrides=overrides, submission_id=SUBMISSION_ID)
        except handler.HandlerError as exc:
            raise CommandError(str(exc)) from None
        what = "submitted" if created else "already submitted"
        self.stdout.write(f"demo run {run.pk} {what} ({run.state}): {base_url.rstrip('/')}/runs/{run.pk}/")
