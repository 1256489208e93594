from django.apps import AppConfig

# Imported with the app, as early as Django allows: prometheus_client fixes its multiprocess mode when it is
# first imported, and jobs.metrics sets the directory before it imports the library.
from jobs.metrics import process_exit


class JobsConfig(AppConfig):
    name = "jobs"
    label = "jobs"
    verbose_name = "Tandem runs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        process_exit.connect_celery()  # Celery's pool processes mark their exit
