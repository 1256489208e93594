"""The middleware list, defined once.

rlplatform.settings installs it; the run-status fast path (jobs.api.fast_status)
reproduces the effects of exactly this list and turns itself off when the
installed list is any other, so a middleware added later (rate limits,
logging, ...) sees every request.
"""

MIDDLEWARE: tuple[str, ...] = (
    "django.middleware.security.SecurityMiddleware",
    "rlplatform.security_headers.ContentSecurityPolicyMiddleware",  # every reply, errors included
    # API input limits (NUL in query strings, oversized bodies) before any session or auth query.
    "rlplatform.input_boundary.InputBoundaryMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
)
