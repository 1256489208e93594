"""The API docs page's content: the OpenAPI schema as endpoint and component tables (no CDN, no script).

jobs.views.api_docs renders it with templates/jobs/api_docs.html. The schema
is generated once per process (drf-spectacular, from the routes and views).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


def api_docs_page() -> dict[str, Any]:
    """The template's context: the schema's ``info``, one row per operation, one table per component."""
    schema = _schema()
    return {"info": schema.get("info", {}), "endpoints": _endpoints(schema), "components": _components(schema)}


@lru_cache(maxsize=1)
def _schema() -> dict:
    from drf_spectacular.generators import SchemaGenerator

    return SchemaGenerator().get_schema(request=None, public=True)


def _ref_name(schema: dict | None) -> str:
    if not schema:
        return ""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if schema.get("type") == "array":
        return f"list of {_ref_name(schema.get('items'))}"
    return schema.get("type", "") or "object"


def _endpoints(schema: dict) -> list[dict]:
    rows = []
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            body = (op.get("requestBody") or {}).get("content", {}).get("application/json", {}).get("schema")
            rows.append(
                {
                    "path": path,
                    "method": method,
                    "summary": op.get("description") or op.get("summary") or "",
                    "tag": (op.get("tags") or [""])[0],
                    "params": [
                        {"name": p["name"], "in": p["in"], "description": p.get("description", "")}
                        for p in op.get("parameters", [])
                    ],
                    "body": _ref_name(body),
                    "responses": [
                        (code, _ref_name((r.get("content") or {}).get("application/json", {}).get("schema")))
                        for code, r in op.get("responses", {}).items()
                    ],
                }
            )
    return rows


def _components(schema: dict) -> list[dict]:
    out = []
    for name, comp in sorted(schema.get("components", {}).get("schemas", {}).items()):
        props = comp.get("properties", {})
        required = set(comp.get("required", []))
        out.append(
            {
                "name": name,
                "fields": [
                    {
                        "name": field,
                        "type": _ref_name(spec) or ("enum" if "enum" in spec else ""),
                        "required": field in required,
                        "read_only": spec.get("readOnly", False),
                        "description": spec.get("description", ""),
                    }
                    for field, spec in props.items()
                ],
            }
        )
    return out
