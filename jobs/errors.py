"""Domain exceptions of the jobs app -> HTTP status codes, in one table.

Views never catch these themselves: they call jobs.handler and let the API's
exception handler look the exception up here (first match wins).

    InvalidInput        400  body {"errors": [{"field": ..., "message": ...}]}
    TokenError, MembershipError
                        400  (same body)
    IllegalTransition   409  e.g. cancelling a COMPLETED run
    Conflict            409  e.g. a submission_id reused with another spec
    ProtectedError      409  deleting something still referenced
    ObjectDoesNotExist  404  also what another team's object looks like
"""

from __future__ import annotations

from rest_framework import status

from jobs.handler import Conflict, InvalidInput
from jobs.states import IllegalTransition
from rlplatform.api import PLATFORM_ERRORS, make_exception_handler

JOBS_ERRORS: list[tuple[type[Exception], int]] = [
    (InvalidInput, status.HTTP_400_BAD_REQUEST),
    (IllegalTransition, status.HTTP_409_CONFLICT),
    (Conflict, status.HTTP_409_CONFLICT),
    *PLATFORM_ERRORS,
]

exception_handler = make_exception_handler(JOBS_ERRORS)
