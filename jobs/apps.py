from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    label = "jobs"
    verbose_name = "Tandem runs"
    default_auto_field = "django.db.models.BigAutoField"
