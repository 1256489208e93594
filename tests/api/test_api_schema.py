"""The OpenAPI schema generates and validates without a single warning; the docs page needs no CDN."""

from __future__ import annotations

import pytest
import yaml
from django.core.management import call_command


def test_schema_generates_without_warnings(tmp_path):
    out = tmp_path / "schema.yaml"
    # --fail-on-warn turns any drf-spectacular warning into an error.
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    schema = yaml.safe_load(out.read_text())
    assert schema["openapi"].startswith("3.")
    for path in ("/api/runs/", "/api/runs/{id}/wait/", "/api/runs/{id}/cancel/", "/api/quotas/{id}/", "/api/tokens/"):
        assert path in schema["paths"], path
    assert schema["components"]["securitySchemes"]["tokenAuth"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "API token: `Authorization: Bearer tdm_...`",
    }


@pytest.mark.django_db
def test_schema_endpoint_and_docs_page_serve_without_a_cdn(client):
    schema = client.get("/api/schema/?format=json")
    assert schema.status_code == 200
    page = client.get("/api/docs/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "/api/runs/{id}/wait/" in html
    assert 'id="schema-RunDetail"' in html
    # Every script or stylesheet is served by us: no external host.
    assert "http://" not in html.replace("http://testserver", "") and "https://" not in html
