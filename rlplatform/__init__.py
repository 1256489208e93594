"""Tandem's Django project and platform app (teams, resource groups, quotas, tokens, audit).

Named rlplatform, not platform: a top-level ``platform`` package would shadow
the standard-library module that uuid (and so Django) imports.
"""

from rlplatform.celery import app as celery_app

__all__ = ("celery_app",)
