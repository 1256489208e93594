"""Routes of the server-rendered pages (namespace ``jobs``)."""

from django.urls import path

from jobs import views

app_name = "jobs"

urlpatterns = [
    path("", views.experiments, name="experiments"),
    path("experiments/<int:pk>/", views.experiment, name="experiment"),
    path("runs/<int:pk>/", views.run_detail, name="run"),
    path("runs/<int:pk>/cancel/", views.run_cancel, name="run-cancel"),
    path("runs/<int:pk>/checkpoints/", views.run_checkpoints, name="run-checkpoints"),
    path("experiments/<int:pk>/compare/", views.compare, name="compare"),
    path("groups/", views.groups, name="groups"),
    path("cluster/", views.cluster, name="cluster"),
    path("quotas/", views.quotas, name="quotas"),
    path("submit/", views.submit, name="submit"),
]
