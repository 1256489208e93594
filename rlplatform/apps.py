from django.apps import AppConfig


class RlplatformConfig(AppConfig):
    name = "rlplatform"
    label = "rlplatform"
    verbose_name = "Tandem platform"
    default_auto_field = "django.db.models.BigAutoField"
