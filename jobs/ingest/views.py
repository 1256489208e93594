"""Thin views of the ingest API: authenticate the run token, hand the JSON body to the handler, map errors.

Errors go through the API's exception table (rlplatform.api.PLATFORM_ERRORS,
extended by jobs.errors.JOBS_ERRORS, plus WrongRun here) and its one error shape:

InvalidInput      400  {"errors": [{"field": "points.3.step", "message": "..."}]}
(input boundary)  400  same shape: malformed, oversized or too deeply nested JSON, NUL characters
(bad run token)   401  {"detail": "...", "errors": [{"field": "request", "message": "..."}]}
WrongRun          403  same shape: a token of run A naming run B
CommandNotFound   404  same shape (it is an ObjectDoesNotExist)
Conflict          409  same shape: e.g. a command acknowledged done, then failed
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from jobs.errors import JOBS_ERRORS
from jobs.ingest import handler
from jobs.ingest.auth import HasRunToken, RunTokenAuthentication
from jobs.metrics import instruments
from rlplatform.api import make_exception_handler
from rlplatform.input_boundary import BoundedJSONParser

# The one row only the ingest API needs (its handler's WrongRun), on top of the jobs API's table.
INGEST_ERRORS: list[tuple[type[Exception], int]] = [(handler.WrongRun, status.HTTP_403_FORBIDDEN), *JOBS_ERRORS]

ingest_exception_handler = make_exception_handler(INGEST_ERRORS)


class IngestView(APIView):
    authentication_classes = [RunTokenAuthentication]
    permission_classes = [HasRunToken]
    parser_classes = [BoundedJSONParser]
    action = staticmethod(handler.ingest_batch)

    def get_exception_handler(self):
        return ingest_exception_handler

    # Not in the public OpenAPI schema: only role processes call these (docs/ingest-and-commands.md).
    @extend_schema(exclude=True)
    def post(self, request):
        return Response(type(self).action(request.auth, request.data))


class MetricsView(IngestView):
    """A reporter batch: ``{run, attempt, role?, points: [...], events: [...]}``. Counted for /metrics:
    its points by outcome when stored, or the batch as rejected with the reply's status."""

    def finalize_response(self, request, response, *args, **kwargs):
        if response.status_code >= 400:
            instruments.count_rejected(response.status_code)
        elif isinstance(getattr(response, "data", None), dict):
            instruments.count_ingested(response.data.get("points", {}))
        return super().finalize_response(request, response, *args, **kwargs)


class CheckpointView(IngestView):
    action = staticmethod(handler.register_checkpoint)


class HeartbeatView(IngestView):
    action = staticmethod(handler.heartbeat)


class CommandResultView(IngestView):
    action = staticmethod(handler.command_result)
