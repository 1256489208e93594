"""Run one role process detached from the worker that starts it, recording its pid and exit status.

    python jobs/rolewrap.py ROLE_DIR -- COMMAND [ARG ...]

The host's Celery worker may restart while a run goes on; the role must
neither die with it nor become its zombie. So this wrapper forks, leaves the
worker's session (its pid becomes the role's process group: one ``killpg``
stops the wrapper and the role together), writes ``ROLE_DIR/pid``, runs the
command with its output appended to ``ROLE_DIR/log``, and writes the exit
status to ``ROLE_DIR/exit_code`` (128 + signal number when a signal killed
it, as a shell reports it). Both files are written atomically (temp file +
rename), so a supervisor never reads half a number. A SIGTERM sent to the
wrapper alone is passed on to the role.

Standard library only, and no Django: it runs on the accelerator host beside
the runtime.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: rolewrap.py ROLE_DIR -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    role_dir, command = Path(argv[1]), argv[3:]
    role_dir.mkdir(parents=True, exist_ok=True)
    if os.fork() > 0:
        return 0  # the launcher waits for this parent only; the child lives on, adopted by init
    os.setsid()
    with open(role_dir / "log", "ab") as log:
        try:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        except OSError as exc:
            log.write(f"error: cannot start {command[0]}: {exc}\n".encode())
            _write_atomic(role_dir / "pid", f"{os.getpid()}\n")
            _write_atomic(role_dir / "exit_code", "127\n")
            os._exit(0)
    signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signal.SIGTERM))
    _write_atomic(role_dir / "pid", f"{os.getpid()}\n")
    code = child.wait()
    _write_atomic(role_dir / "exit_code", f"{128 - code if code < 0 else code}\n")
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
