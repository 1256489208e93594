"""REST API of the jobs app (experiments, runs, quotas); mounted under /api/ by rlplatform.urls."""
