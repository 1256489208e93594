"""The one input boundary of the API: what no endpoint's code has to check again.

Every request under /api/ is refused with a 400 in the API's error shape
(``{"errors": [{"field": ..., "message": ...}]}``, rlplatform.api) when

- a query parameter (name or value) holds a NUL character or a lone surrogate
  (PostgreSQL cannot compare or store either: a filter on one was a 500);
- the body is larger than ``DATA_UPLOAD_MAX_MEMORY_SIZE`` (Django's own check
  answers with an HTML page);
- the JSON body is malformed, not UTF-8, nested deeper than
  ``runtime.spec.MAX_NESTING`` levels (Python's parser recurses per level: a
  ``[[[...]]]`` body was a RecursionError), or holds a NUL or lone surrogate in
  any string or key.

``InputBoundaryMiddleware`` checks the query string and the declared size before
any view runs (and turns Django's HTML 404 for an unrouted API path into JSON); ``BoundedJSONParser`` (the API's only parser) checks bodies as it
parses them. Both raise or answer ``InputRejected``, which the API's exception
table maps to 400. The spec loader applies the same limits to spec text
(runtime.spec), so the runtime's CLI is protected too.
"""

from __future__ import annotations

import json
import re
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, JsonResponse
from rest_framework.parsers import JSONParser

from runtime.spec import MAX_NESTING, MAX_REPORTED_ERRORS, data_problems, text_problem

API_PREFIX = "/api/"


class InputRejected(Exception):
    """Input refused at the boundary (400). ``errors``: ``[{"field": "spec.name", "message": "..."}]``."""

    def __init__(self, errors: list[dict[str, str]]):
        self.errors = errors
        super().__init__("; ".join(f"{e['field']}: {e['message']}" for e in errors))

    @classmethod
    def one(cls, field: str, message: str) -> InputRejected:
        return cls([{"field": field, "message": message}])


def body_limit() -> int | None:
    return settings.DATA_UPLOAD_MAX_MEMORY_SIZE


def too_large(limit: int) -> InputRejected:
    return InputRejected.one("body", f"larger than the limit of {limit} bytes")


def query_errors(request: HttpRequest) -> list[dict[str, str]]:
    """Field errors for query parameters that are not storable text, named by parameter."""
    errors = []
    for name, values in request.GET.lists():
        problem = text_problem(name)
        if problem:
            errors.append({"field": "query", "message": f"a parameter name {problem}"})
            continue
        for value in values:
            problem = text_problem(value)
            if problem:
                errors.append({"field": name, "message": problem})
                break
        if len(errors) >= MAX_REPORTED_ERRORS:
            break
    return errors


def declared_size_errors(request: HttpRequest) -> list[dict[str, str]]:
    limit = body_limit()
    try:
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return []  # Django and DRF read such a body as empty
    if limit is not None and declared > limit:
        return too_large(limit).errors
    return []


class InputBoundaryMiddleware:
    """Refuses bad query strings and oversized bodies of API requests before any view (sync and async)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if self.is_async:
            return self._acall(request)
        return self._refusal(request) or self._json_not_found(request, self.get_response(request))

    async def _acall(self, request: HttpRequest):
        return self._refusal(request) or self._json_not_found(request, await self.get_response(request))

    @staticmethod
    def _json_not_found(request: HttpRequest, response):
        """An API path no route matches (``/api/runs/0.5/``) answers like any other API 404, not in HTML."""
        if (
            response.status_code == 404
            and request.path_info.startswith(API_PREFIX)
            and not response.get("Content-Type", "").startswith("application/json")
        ):
            return JsonResponse({"detail": "Not found."}, status=404)
        return response

    @staticmethod
    def _refusal(request: HttpRequest) -> JsonResponse | None:
        if not request.path_info.startswith(API_PREFIX):
            return None
        errors = query_errors(request) + declared_size_errors(request)
        return JsonResponse({"errors": errors}, status=400) if errors else None


# A JSON string literal (escapes included), and any run of characters that is not a bracket.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")


def too_deep(raw: bytes) -> bool:
    """Whether the JSON text ``raw`` opens more than MAX_NESTING brackets at once (strings skipped).

    Checked before parsing, so the parser never recurses deeper than the limit."""
    depth = 0
    for char in _NOT_BRACKET.sub(b"", _JSON_STRING.sub(b"", raw)):
        if char in b"[{":
            depth += 1
            if depth > MAX_NESTING:
                return True
        else:
            depth -= 1
    return False


def parse_json_body(raw: bytes, encoding: str = "utf-8") -> Any:
    """The parsed JSON body, or InputRejected naming the problem (and the field, for bad strings)."""
    try:
        text = raw.decode(encoding)
    except (UnicodeDecodeError, LookupError):
        raise InputRejected.one("body", f"not valid {encoding} text") from None
    if too_deep(raw):
        raise InputRejected.one("body", f"nested deeper than {MAX_NESTING} levels")
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as exc:
        raise InputRejected.one("body", f"malformed JSON: {exc}") from None
    errors = data_problems(data)
    if errors:
        raise InputRejected(errors)
    return data


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class BoundedJSONParser(JSONParser):
    """DRF's JSON parser within the boundary's limits: size, UTF-8, depth, storable strings."""

    def parse(self, stream, media_type=None, parser_context=None) -> Any:
        encoding = (parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET
        limit = body_limit()
        raw = stream.read() if limit is None else stream.read(limit + 1)
        if limit is not None and len(raw) > limit:
            raise too_large(limit)
        return parse_json_body(raw, encoding)
