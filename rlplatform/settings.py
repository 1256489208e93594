"""Django settings for Tandem, read from environment variables.

Every knob comes through the typed helpers in ``rlplatform.env``; unset
variables give embedded defaults that run on one machine (SQLite under
``var/``, an in-process channel layer, a filesystem Celery broker under ``var/celery/``).
docs/control-plane-model.md lists every variable.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from rlplatform import middleware_stack
from rlplatform.env import env_bool, env_float, env_int, env_list, env_str, parse_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("TANDEM_VAR_DIR", str(BASE_DIR / "var")))

DEBUG = env_bool("DEBUG", False)
SECRET_KEY = env_str("SECRET_KEY")
if not SECRET_KEY:
    # pytest-django loads settings before any conftest can set variables, so a
    # test run gets a throwaway key; every other start without one is an error.
    if "pytest" in sys.modules:
        SECRET_KEY = secrets.token_urlsafe(50)
    elif not DEBUG:
        raise ImproperlyConfigured(
            "environment variable SECRET_KEY is required when DEBUG is off (set DEBUG=true for local development)"
        )
    else:  # DEBUG on: a fixed development key, so sessions survive restarts.
        SECRET_KEY = "tandem-insecure-development-key-do-not-use-in-production"

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

# Behind a TLS-terminating proxy: secure cookies, redirect plain HTTP, trust X-Forwarded-Proto.
TANDEM_HTTPS = env_bool("TANDEM_HTTPS", False)
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = SECURE_SSL_REDIRECT = TANDEM_HTTPS
if TANDEM_HTTPS:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_HSTS_SECONDS = env_int("TANDEM_HSTS_SECONDS", 0, minimum=0)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "rlplatform.apps.RlplatformConfig",
    "jobs.apps.JobsConfig",
]

# A list, so a deployment or a test can change it (which turns the run-status fast path off).
MIDDLEWARE = list(middleware_stack.MIDDLEWARE)

ROOT_URLCONF = "rlplatform.urls"
WSGI_APPLICATION = "rlplatform.wsgi.application"
ASGI_APPLICATION = "rlplatform.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -----------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL")
if DATABASE_URL:
    _default_db = parse_database_url(DATABASE_URL)
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    _default_db = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(VAR_DIR / "tandem.sqlite3")}
if _default_db["ENGINE"].endswith("sqlite3"):
    # The demo's web server, worker and beat share one file: WAL lets readers run beside
    # the writer, IMMEDIATE takes the write lock up front (no upgrade deadlocks), and
    # writers wait up to 20 s instead of failing with "database is locked".
    _default_db.setdefault("OPTIONS", {}).update(
        {"timeout": 20, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
# Under ASGI every sync request runs in a thread of its own, so thread-local persistent
# connections are never reused: on PostgreSQL a connection pool (psycopg_pool, per process)
# hands each request a warm connection instead of a new connect and backend fork.
_is_postgres = _default_db["ENGINE"].endswith("postgresql")
DATABASE_POOL = env_bool("DATABASE_POOL", _is_postgres)
DATABASE_POOL_MIN = env_int("DATABASE_POOL_MIN", 2, minimum=0)
# Per process (each uvicorn worker, each Celery worker process). 16 covers a web worker's concurrent
# requests: long-polls hold no connection while they wait (jobs/longpoll.py). Keep workers x MAX, plus
# Celery's, below PostgreSQL's max_connections (README, Configuration).
DATABASE_POOL_MAX = env_int("DATABASE_POOL_MAX", 16, minimum=1)
DATABASE_POOL_TIMEOUT_S = env_float("DATABASE_POOL_TIMEOUT_S", 10.0, minimum=0.1)
if DATABASE_POOL and not _is_postgres:
    raise ImproperlyConfigured("DATABASE_POOL=true needs PostgreSQL (DATABASE_URL=postgres://...)")
if DATABASE_POOL_MIN > DATABASE_POOL_MAX:
    raise ImproperlyConfigured(
        f"DATABASE_POOL_MIN={DATABASE_POOL_MIN} must not exceed DATABASE_POOL_MAX={DATABASE_POOL_MAX}"
    )
if DATABASE_POOL:
    _default_db.setdefault("OPTIONS", {})["pool"] = {
        "min_size": DATABASE_POOL_MIN,
        "max_size": DATABASE_POOL_MAX,
        "timeout": DATABASE_POOL_TIMEOUT_S,
    }
    _default_db["CONN_MAX_AGE"] = 0  # Django refuses persistent connections with a pool
else:
    # Persistent connections save a connect per request; health checks drop dead ones.
    _default_db["CONN_MAX_AGE"] = env_int("DATABASE_CONN_MAX_AGE", 60, minimum=0)
    _default_db["CONN_HEALTH_CHECKS"] = True
DATABASES = {"default": _default_db}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: Celery broker and channel layer -------------------------------------
REDIS_URL = env_str("REDIS_URL")
if REDIS_URL:
    # socket_timeout above channels_redis's 5 s blocking pop: redis-py's default read timeout is also
    # 5 s, and an idle WebSocket consumer's pop then dies with "Timeout reading" (live UI, tests/live).
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
# The cache holds login-throttle counts (rlplatform/login_throttle.py): in Redis every web process
# shares them; without Redis, the one web process's memory.
if REDIS_URL:
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "tandem",
            "OPTIONS": {"socket_timeout": 5, "socket_connect_timeout": 5},
        }
    }

# Celery (rlplatform/celery.py reads the CELERY_* names). Without Redis, a
# filesystem broker under var/ lets the web process, a local worker and beat
# share queues on one machine with nothing else installed.
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
    CELERY_RESULT_BACKEND = REDIS_URL
else:
    _celery_dir = VAR_DIR / "celery"
    for _sub in ("queue", "processed", "results", "control"):
        (_celery_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_celery_dir / "queue"),
        "data_folder_out": str(_celery_dir / "queue"),
        "processed_folder": str(_celery_dir / "processed"),
        # kombu's default is ./control relative to the working directory.
        "control_folder": str(_celery_dir / "control"),
        "store_processed": False,
    }
    CELERY_RESULT_BACKEND = f"file://{_celery_dir / 'results'}"
    # No event loop on this broker: Celery would give a prefork worker billiard's blocking pool, whose
    # processes share one lock on the task pipe. A SIGTERM that reaches them as well as the worker (a
    # process-group kill, pkill -f, a service manager) can leave that lock held by a dead process, and the
    # worker's exit then waits on it forever (the pool's exit finalizer). The local worker's tasks are short
    # database passes and process launches: threads run them without processes to lose.
    CELERY_WORKER_POOL = "threads"
# Eager: tasks run inside the caller (no worker at all); for scripts and debugging.
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_EAGER_PROPAGATES = True
# Platform tasks go to "default"; each host's worker also consumes its own Host.queue ("host.<name>").
CELERY_TASK_DEFAULT_QUEUE = "default"
CELERY_TASK_ROUTES = {"jobs.tasks.*": {"queue": "default"}}
CELERY_TASK_TIME_LIMIT = env_int("CELERY_TASK_TIME_LIMIT", 300, minimum=1)
CELERY_TASK_SOFT_TIME_LIMIT = max(1, CELERY_TASK_TIME_LIMIT - 30)
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
TANDEM_ADMISSION_INTERVAL_S = env_float("TANDEM_ADMISSION_INTERVAL_S", 10.0, minimum=0.5)
TANDEM_ACCOUNTING_INTERVAL_S = env_float("TANDEM_ACCOUNTING_INTERVAL_S", 60.0, minimum=1.0)
# Host agents (docs/host-agents.md): heartbeat period, and the silence after which a host is LOST.
TANDEM_HEARTBEAT_S = env_float("TANDEM_HEARTBEAT_S", 10.0, minimum=0.1)
TANDEM_HOST_GRACE_S = env_float("TANDEM_HOST_GRACE_S", 60.0, minimum=1.0)
if TANDEM_HOST_GRACE_S < 2 * TANDEM_HEARTBEAT_S:
    # One late heartbeat must not make a host flap between ONLINE and LOST.
    raise ImproperlyConfigured(
        f"TANDEM_HOST_GRACE_S={TANDEM_HOST_GRACE_S:g} must be at least twice TANDEM_HEARTBEAT_S={TANDEM_HEARTBEAT_S:g}"
    )
# Live UI (docs/live-ui-backend.md): checkpoint files are served and deleted only inside this
# directory; retention of old checkpoints runs this often.
TANDEM_CHECKPOINT_ROOT = Path(env_str("TANDEM_CHECKPOINT_ROOT", str(BASE_DIR / "runs"))).resolve()
TANDEM_RETENTION_INTERVAL_S = env_float("TANDEM_RETENTION_INTERVAL_S", 300.0, minimum=1.0)
# Path confinement (jobs/confinement.py): besides its own runs' directories and its admin-set data roots,
# every team's specs may name files under this read-only model directory. Unset: no shared root.
_shared_model_root = env_str("TANDEM_SHARED_MODEL_ROOT")
if _shared_model_root is not None and not Path(_shared_model_root).is_absolute():
    raise ImproperlyConfigured(f"environment variable TANDEM_SHARED_MODEL_ROOT={_shared_model_root!r} is not absolute")
TANDEM_SHARED_MODEL_ROOT = Path(_shared_model_root).resolve() if _shared_model_root is not None else None
# Algorithm plug-ins (jobs/confinement.py): a spec's `algorithm.name: package.module:factory` makes the run's
# hosts import that module; the platform allows only modules under these comma-separated prefixes (none unset).
TANDEM_ALGORITHM_PLUGINS = env_list("TANDEM_ALGORITHM_PLUGINS", [])
# The capacity planner (jobs/planning.py): the calibration whose costs predict runs on each device kind, as
# comma-separated kind=calibration pairs; a calibration is a name under capacity/calibrations/ or a JSON
# file's path. An accelerator kind without one is planned on costs derived from its hardware preset.
TANDEM_CAPACITY_CALIBRATIONS: dict[str, str] = {}
for _pair in env_list("TANDEM_CAPACITY_CALIBRATIONS", ["cpu=cpu-2core"]):
    _kind, _sep, _calibration = (part.strip() for part in _pair.partition("="))
    if not _sep or _kind not in ("cpu", "gpu", "npu") or not _calibration:
        raise ImproperlyConfigured(
            f"environment variable TANDEM_CAPACITY_CALIBRATIONS: {_pair!r} is not kind=calibration "
            "(kind cpu, gpu or npu)"
        )
    TANDEM_CAPACITY_CALIBRATIONS[_kind] = _calibration
# Role processes (docs/running-runs.md): each run's directory is <TANDEM_CHECKPOINT_ROOT>/run-<id> (shared
# storage in a cluster, so a restarted role finds its checkpoints); roles reach the platform at
# TANDEM_PLATFORM_URL; host supervisors look at their processes every TANDEM_SUPERVISE_S; a live process
# that has not heartbeated for TANDEM_ROLE_HANG_S is hung and killed (then restarted); a start task not
# claimed within TANDEM_LAUNCH_TIMEOUT_S is sent again (the broker may have lost it).
TANDEM_PLATFORM_URL = env_str("TANDEM_PLATFORM_URL", "http://127.0.0.1:8000")
if not TANDEM_PLATFORM_URL.startswith(("http://", "https://")):
    raise ImproperlyConfigured(
        f"environment variable TANDEM_PLATFORM_URL={TANDEM_PLATFORM_URL!r} is not an http(s) URL"
    )
TANDEM_SUPERVISE_S = env_float("TANDEM_SUPERVISE_S", 2.0, minimum=0.1)
TANDEM_ROLE_HEARTBEAT_S = env_float("TANDEM_ROLE_HEARTBEAT_S", 5.0, minimum=0.1)
TANDEM_ROLE_HANG_S = env_float("TANDEM_ROLE_HANG_S", 600.0, minimum=1.0)
TANDEM_LAUNCH_TIMEOUT_S = env_float("TANDEM_LAUNCH_TIMEOUT_S", 120.0, minimum=1.0)
TANDEM_WATCH_ROLES_S = env_float("TANDEM_WATCH_ROLES_S", 10.0, minimum=0.5)
# A role that fails this many times on one host has its run requeued away from that host.
TANDEM_HOST_FAILURE_LIMIT = env_int("TANDEM_HOST_FAILURE_LIMIT", 2, minimum=1)
# Alerts (jobs/alerts/, README "Alerts"): how often beat looks for runs without a new step (one query),
# and the webhook deliveries' retries (base x 2**n seconds apart), timeout, and whether they may reach
# private addresses (off: loopback, private, link-local and reserved addresses are refused, against SSRF).
TANDEM_ALERT_CHECK_S = env_float("TANDEM_ALERT_CHECK_S", 30.0, minimum=1.0)
TANDEM_ALERT_WEBHOOK_RETRIES = env_int("TANDEM_ALERT_WEBHOOK_RETRIES", 5, minimum=0, maximum=20)
TANDEM_ALERT_WEBHOOK_BACKOFF_S = env_float("TANDEM_ALERT_WEBHOOK_BACKOFF_S", 2.0, minimum=0.01)
TANDEM_ALERT_WEBHOOK_TIMEOUT_S = env_float("TANDEM_ALERT_WEBHOOK_TIMEOUT_S", 5.0, minimum=0.1)
TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE = env_bool("TANDEM_ALERT_WEBHOOK_ALLOW_PRIVATE", False)
TANDEM_ALERT_QUEUE = "default"  # the deliveries' Celery queue
CELERY_BEAT_SCHEDULE = {
    "watch-roles": {"task": "jobs.tasks.watch_roles", "schedule": TANDEM_WATCH_ROLES_S},
    "admit-pending": {"task": "jobs.tasks.admit_pending", "schedule": TANDEM_ADMISSION_INTERVAL_S},
    "accrue-device-time": {"task": "jobs.tasks.accrue_device_time", "schedule": TANDEM_ACCOUNTING_INTERVAL_S},
    "mark-lost-hosts": {"task": "rlplatform.tasks.mark_lost_hosts", "schedule": TANDEM_HEARTBEAT_S},
    "apply-checkpoint-retention": {
        "task": "jobs.tasks.apply_checkpoint_retention",
        "schedule": TANDEM_RETENTION_INTERVAL_S,
    },
    "alerts-no-step": {"task": "jobs.alerts.check_silent_runs", "schedule": TANDEM_ALERT_CHECK_S},
}

# --- Platform knobs -------------------------------------------------------------
# Limits of the quota created with an experiment when none is given.
TANDEM_DEFAULT_QUOTA = {
    "max_devices": env_int("TANDEM_DEFAULT_MAX_DEVICES", 8, minimum=0),
    "max_concurrent_runs": env_int("TANDEM_DEFAULT_MAX_RUNS", 4, minimum=0),
    "max_rollout_workers": env_int("TANDEM_DEFAULT_MAX_ROLLOUT_WORKERS", 64, minimum=0),
    "device_hour_budget": env_float("TANDEM_DEFAULT_DEVICE_HOURS", None, minimum=0.0),
}
# Off: a run that waits for free devices holds back lower-ordered runs of its
# group (no starvation of large gangs). On: smaller runs may jump ahead.
TANDEM_ADMISSION_BACKFILL = env_bool("TANDEM_ADMISSION_BACKFILL", False)
TANDEM_TOKEN_TTL_DAYS = env_int("TANDEM_TOKEN_TTL_DAYS", 90, minimum=1, maximum=3650)
# /metrics (jobs/metrics/): the counters that only a web process sees (ingest, command acks) are kept in
# prometheus_client's multiprocess files here, shared by the processes of one machine and summed at scrape
# time. One directory per machine (and per container: the files are named by pid); wiped at service start
# (`python manage.py reset_metrics_dir`).
TANDEM_PROMETHEUS_DIR = Path(env_str("PROMETHEUS_MULTIPROC_DIR", str(VAR_DIR / "prometheus")))
# Open live-UI WebSockets re-check their user's access this often (jobs/consumers.py), besides at once
# on a membership change: the backstop for changes made outside rlplatform.memberships.
TANDEM_WS_ACCESS_RECHECK_S = env_float("TANDEM_WS_ACCESS_RECHECK_S", 30.0, minimum=0.1)
# The Cluster page's device rows (utilisation, memory, holder) reach an open page at most this often
# (jobs/consumers.py): however many heartbeats arrive meanwhile, each socket reads once and sends what changed.
TANDEM_CLUSTER_LIVE_S = env_float("TANDEM_CLUSTER_LIVE_S", 2.0, minimum=0.05)

# --- Auth, REST framework, OpenAPI -------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Usernames and passwords are checked through the login throttle (rlplatform/login_throttle.py).
AUTHENTICATION_BACKENDS = ["rlplatform.login_throttle.ThrottledModelBackend"]
TANDEM_LOGIN_MAX_FAILURES = env_int("TANDEM_LOGIN_MAX_FAILURES", 5, minimum=1)
TANDEM_LOGIN_MAX_FAILURES_PER_ADDRESS = env_int("TANDEM_LOGIN_MAX_FAILURES_PER_ADDRESS", 20, minimum=1)
TANDEM_LOGIN_LOCKOUT_S = env_int("TANDEM_LOGIN_LOCKOUT_S", 900, minimum=1)
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rlplatform.api_auth.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "rlplatform.api.APIAutoSchema",
    # JSON only, within the input boundary's limits (rlplatform/input_boundary.py).
    "DEFAULT_PARSER_CLASSES": ["rlplatform.input_boundary.BoundedJSONParser"],
    "EXCEPTION_HANDLER": "rlplatform.api.platform_exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Tandem API",
    "DESCRIPTION": "Control plane of Tandem: teams, resource groups, quotas, experiments and runs.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
}

# --- I18N, static files, logging ----------------------------------------------------
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "frontend"]
STATIC_ROOT = Path(env_str("STATIC_ROOT", str(BASE_DIR / "static_root")))

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}
