"""The API's one error shape: every error reply's body is ``{"errors": [{"field": ..., "message": ...}]}``.

A 400 names each field at fault (dotted paths such as ``spec.resources.trainer_devices``).
Any other error (401, 403, 404, 405, 409, 415, 429, ...) is about the request as a
whole: one error whose field is ``request``, its message repeated as ``detail``
(what clients read before the errors shape, and still do: the web UI's api.js).
Plain data, no Django: rlplatform.api renders these, and the input boundary can too.
"""

from __future__ import annotations

from typing import Any

WHOLE_REQUEST = "request"  # the field of an error about the request as a whole


def field_errors_body(errors: list[dict[str, str]]) -> dict[str, Any]:
    """The body of a 400: ``errors`` as given, each ``{"field": ..., "message": ...}``."""
    return {"errors": errors}


def refusal_body(message: str) -> dict[str, Any]:
    """The body of any other error reply."""
    return {"detail": message, "errors": [{"field": WHOLE_REQUEST, "message": message}]}
