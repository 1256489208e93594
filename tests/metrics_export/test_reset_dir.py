"""``manage.py reset_metrics_dir``: the multiprocess files of an earlier start are gone, nothing else is."""

from __future__ import annotations

from django.core.management import call_command


def test_reset_removes_the_db_files_only(settings, tmp_path, capsys):
    settings.TANDEM_PROMETHEUS_DIR = tmp_path
    for name in ("counter_123.db", "histogram_123.db", "counter_456.db"):
        (tmp_path / name).write_bytes(b"\0" * 8)
    (tmp_path / "README").write_text("kept")
    call_command("reset_metrics_dir")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README"]
    assert "removed 3 file(s)" in capsys.readouterr().out
