"""Server-rendered pages: login required, team visibility, submit with inline field errors, cancel."""

from __future__ import annotations

import pytest

from jobs.models import Run
from jobs.states import RunState

pytestmark = pytest.mark.django_db


@pytest.fixture
def pages(experiment, submit):
    run = submit(experiment, 2)
    return [
        "/",
        f"/experiments/{experiment.pk}/",
        f"/runs/{run.pk}/",
        "/groups/",
        "/submit/",
    ]


def test_anonymous_users_are_sent_to_login(client, pages):
    for path in pages:
        response = client.get(path)
        assert response.status_code == 302, path
        assert response["Location"] == f"/login/?next={path}", path


def test_login_page_logs_in_and_lands_on_experiments(client, editor):
    page = client.get("/login/")
    assert page.status_code == 200
    assert 'name="csrfmiddlewaretoken"' in page.content.decode()
    response = client.post("/login/", {"username": "editor", "password": "editor-pass-123"})
    assert (response.status_code, response["Location"]) == (302, "/")
    assert client.get("/").status_code == 200


def test_member_pages_render_state_reason_and_usage(client, viewer, experiment, submit):
    admitted = [submit(experiment, 2) for _ in range(4)]
    queued = submit(experiment, 1)
    client.force_login(viewer)
    html = client.get("/").content.decode()
    assert "exp-a" in html and "team-a" in html
    html = client.get(f"/experiments/{experiment.pk}/").content.decode()
    assert f'href="/runs/{queued.pk}/"' in html and f'href="/runs/{admitted[0].pk}/"' in html
    html = client.get(f"/runs/{queued.pk}/").content.decode()
    queued.refresh_from_db()
    assert "<dt>Queue position</dt><dd>1</dd>" in html
    assert queued.reason in html
    assert "Cancel run" not in html  # a viewer cannot cancel
    html = client.get(f"/runs/{admitted[0].pk}/").content.decode()
    assert "cpu-local-h1:0" in html and "trainer_devices: 2" in html
    html = client.get("/groups/").content.decode()
    assert "<dt>Used</dt><dd>8" in html and "<dt>Free</dt><dd>0</dd>" in html


def test_other_teams_run_page_is_404(client, outsider, experiment, submit):
    run = submit(experiment)
    client.force_login(outsider)
    assert client.get(f"/runs/{run.pk}/").status_code == 404
    assert client.get(f"/experiments/{experiment.pk}/").status_code == 404
    assert client.post(f"/runs/{run.pk}/cancel/").status_code == 404
    run.refresh_from_db()
    assert run.state == RunState.ADMITTED


def test_submit_page_shows_spec_field_errors_inline_and_writes_nothing(client, editor, experiment):
    client.force_login(editor)
    spec = "name: t\npipeline:\n  mode: turbo\nresources:\n  trainer_devics: 1\n"
    response = client.post("/submit/", {"experiment": experiment.pk, "spec": spec})
    assert response.status_code == 400
    html = response.content.decode()
    assert (
        '<li data-field="pipeline.mode"><code>pipeline.mode</code>: '
        "Input should be &#x27;sync&#x27;, &#x27;async&#x27; or &#x27;colocated&#x27;</li>"
    ) in html
    assert '<li data-field="resources.trainer_devics"><code>resources.trainer_devics</code>: unknown field</li>' in html
    assert "trainer_devics: 1" in html  # the text the user typed is kept
    assert Run.objects.count() == 0


def test_submit_page_shows_request_field_errors_next_to_the_field(client, editor, experiment):
    client.force_login(editor)
    response = client.post(
        "/submit/", {"experiment": experiment.pk, "spec": "name: t\n", "submission_id": "bad id", "priority": "9999"}
    )
    html = response.content.decode()
    assert '<div class="field-error" data-field="submission_id">1-128 characters' in html
    assert '<div class="field-error" data-field="priority">must be an integer from -1000 to 1000</div>' in html
    assert Run.objects.count() == 0


def test_submit_page_queues_a_run_and_redirects_to_it(client, editor, experiment):
    client.force_login(editor)
    page = client.get(f"/submit/?experiment={experiment.pk}")
    assert page.status_code == 200
    assert f'<option value="{experiment.pk}" selected>team-a / exp-a</option>' in page.content.decode()
    response = client.post("/submit/", {"experiment": experiment.pk, "spec": "name: web\n", "submission_id": "w1"})
    run = Run.objects.get()
    assert (response.status_code, response["Location"]) == (302, f"/runs/{run.pk}/")
    assert (run.name, run.submission_id, run.created_by) == ("web", "w1", editor)


def test_viewer_cannot_pick_an_experiment_to_submit_to(client, viewer, experiment):
    client.force_login(viewer)
    assert "you cannot submit runs" in client.get("/submit/").content.decode()
    response = client.post("/submit/", {"experiment": experiment.pk, "spec": "name: x\n"})
    assert response.status_code == 400
    assert Run.objects.count() == 0


def test_cancel_from_the_run_page(client, editor, experiment, submit):
    run = submit(experiment)
    client.force_login(editor)
    assert "Cancel run" in client.get(f"/runs/{run.pk}/").content.decode()
    response = client.post(f"/runs/{run.pk}/cancel/")
    assert response.status_code == 302
    run.refresh_from_db()
    assert (run.state, run.reason) == (RunState.CANCELLED, "cancelled by editor")


def test_pages_use_the_local_stylesheet_only(client, viewer, experiment):
    client.force_login(viewer)
    html = client.get("/").content.decode()
    assert '<link rel="stylesheet" href="/static/css/tandem.css">' in html
    assert "https://" not in html


def test_admin_site_is_mounted(client, superuser):
    client.force_login(superuser)
    assert client.get("/admin/").status_code == 200
    assert client.get("/admin/rlplatform/quota/").status_code == 200


def test_the_stylesheet_is_served_without_debug(client, settings):
    settings.DEBUG = False
    response = client.get("/static/css/tandem.css")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/css")
    assert b"--accent" in response.content
    from django.test import Client

    # Nothing outside the static folders: a path escaping them is refused.
    outside = Client(raise_request_exception=False).get("/static/../rlplatform/settings.py")
    assert outside.status_code == 400
    assert client.get("/static/css/missing.css").status_code == 404
