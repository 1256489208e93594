"""Settings from the environment: typed helpers fail loudly naming the variable; SECRET_KEY is required."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from rlplatform.env import env_bool, env_float, env_int, env_list, env_str, parse_database_url

ROOT = Path(__file__).resolve().parents[2]


def test_env_helpers_parse_and_default(monkeypatch):
    monkeypatch.setenv("T_BOOL", "Yes")
    monkeypatch.setenv("T_INT", " 42 ")
    monkeypatch.setenv("T_LIST", "a.example, b.example ,,")
    monkeypatch.setenv("T_FLOAT", "2.5")
    monkeypatch.setenv("T_EMPTY", "")
    assert env_bool("T_BOOL", False) is True
    assert env_int("T_INT", 0) == 42
    assert env_list("T_LIST", []) == ["a.example", "b.example"]
    assert env_float("T_FLOAT", None) == 2.5
    assert env_str("T_EMPTY", "default") == "default"
    assert env_int("T_UNSET_XYZ", 7) == 7


@pytest.mark.parametrize(
    "call,value,message",
    [
        (lambda: env_bool("T_V", False), "ture", "T_V='ture' is not a boolean"),
        (lambda: env_int("T_V", 0), "ten", "T_V='ten' is not an integer"),
        (lambda: env_int("T_V", 0, minimum=1), "0", "T_V=0 is below the minimum 1"),
        (lambda: env_float("T_V", None), "x", "T_V='x' is not a number"),
        (lambda: env_str("T_V_UNSET", required=True), None, "T_V_UNSET is required"),
    ],
)
def test_bad_values_fail_naming_the_variable(monkeypatch, call, value, message):
    if value is not None:
        monkeypatch.setenv("T_V", value)
    with pytest.raises(ImproperlyConfigured, match=message):
        call()


def test_database_url_parsing():
    assert parse_database_url("postgres://tan%40dem:p%2Fw@db.local:5433/tandem?sslmode=require") == {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": "tandem",
        "USER": "tan@dem",
        "PASSWORD": "p/w",
        "HOST": "db.local",
        "PORT": "5433",
        "OPTIONS": {"sslmode": "require"},
    }
    assert parse_database_url("sqlite:////tmp/x.sqlite3") == {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": "/tmp/x.sqlite3",
    }
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL has unsupported scheme 'mysql'"):
        parse_database_url("mysql://u@h/db")
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL names no database"):
        parse_database_url("postgres://u@h:5432/")


def _load_settings(env):
    clean = {k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DEBUG", "DATABASE_URL", "REDIS_URL")}
    clean.update(env)
    code = "import rlplatform.settings as s; print(s.DATABASES['default']['ENGINE'], s.CELERY_BROKER_URL, s.CHANNEL_LAYERS['default']['BACKEND'])"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean, capture_output=True, text=True)


def test_secret_key_is_required_without_debug(tmp_path):
    result = _load_settings({"TANDEM_VAR_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert "ImproperlyConfigured: environment variable SECRET_KEY is required when DEBUG is off" in result.stderr


def test_embedded_defaults_without_database_and_redis(tmp_path):
    result = _load_settings({"TANDEM_VAR_DIR": str(tmp_path), "DEBUG": "true"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "django.db.backends.sqlite3",
        "filesystem://",
        "channels.layers.InMemoryChannelLayer",
    ]
    assert (tmp_path / "celery" / "queue").is_dir()


def test_redis_url_switches_broker_and_channel_layer(tmp_path):
    result = _load_settings(
        {"SECRET_KEY": "x" * 50, "REDIS_URL": "redis://127.0.0.1:1/0", "TANDEM_VAR_DIR": str(tmp_path)}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "django.db.backends.sqlite3",
        "redis://127.0.0.1:1/0",
        "channels_redis.core.RedisChannelLayer",
    ]


def test_bad_debug_value_stops_startup(tmp_path):
    result = _load_settings({"DEBUG": "maybe", "TANDEM_VAR_DIR": str(tmp_path)})
    assert result.returncode != 0
    assert "DEBUG='maybe' is not a boolean" in result.stderr
