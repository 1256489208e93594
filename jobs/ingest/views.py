"""Thin views of the ingest API: authenticate the run token, hand the JSON body to the handler, map errors.

InvalidInput      400  {"errors": [{"field": "points[3].step", "message": "..."}]}
WrongRun          403  {"detail": "..."}   a token of run A naming run B
CommandNotFound   404
Conflict          409  e.g. a command acknowledged done, then failed
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView, exception_handler

from jobs.commands import CommandNotFound
from jobs.handler import Conflict, InvalidInput
from jobs.ingest import handler
from jobs.ingest.auth import HasRunToken, RunTokenAuthentication

ERRORS: list[tuple[type[Exception], int]] = [
    (InvalidInput, status.HTTP_400_BAD_REQUEST),
    (handler.WrongRun, status.HTTP_403_FORBIDDEN),
    (CommandNotFound, status.HTTP_404_NOT_FOUND),
    (Conflict, status.HTTP_409_CONFLICT),
]


def ingest_exception_handler(exc, context):
    for exc_type, code in ERRORS:
        if isinstance(exc, exc_type):
            if isinstance(exc, InvalidInput):
                return Response({"errors": exc.errors}, status=code)
            return Response({"detail": str(exc)}, status=code)
    return exception_handler(exc, context)


class IngestView(APIView):
    authentication_classes = [RunTokenAuthentication]
    permission_classes = [HasRunToken]
    parser_classes = [JSONParser]
    action = staticmethod(handler.ingest_batch)

    def get_exception_handler(self):
        return ingest_exception_handler

    # Not in the public OpenAPI schema: only role processes call these (docs/ingest-and-commands.md).
    @extend_schema(exclude=True)
    def post(self, request):
        return Response(type(self).action(request.auth, request.data))


class MetricsView(IngestView):
    """A reporter batch: ``{run, attempt, role?, points: [...], events: [...]}``."""


class CheckpointView(IngestView):
    action = staticmethod(handler.register_checkpoint)


class HeartbeatView(IngestView):
    action = staticmethod(handler.heartbeat)


class CommandResultView(IngestView):
    action = staticmethod(handler.command_result)
