#!/usr/bin/env bash
# `make demo`: the platform with embedded defaults (SQLite, in-process channel
# layer, a local Celery worker on a filesystem broker), a demo admin, a local
# CPU resource group, and a demo RL run of the runtime on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
export TANDEM_VAR_DIR=${TANDEM_VAR_DIR:-$PWD/var}
export DEBUG=${DEBUG:-true}
mkdir -p "$TANDEM_VAR_DIR/logs"

"$BIN/python" manage.py migrate --noinput >/dev/null
"$BIN/python" manage.py demo_setup

pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

"$BIN/celery" -A rlplatform worker --loglevel=info --concurrency=2 --queues=default,host.local \
    >"$TANDEM_VAR_DIR/logs/worker.log" 2>&1 &
pids+=($!)
"$BIN/celery" -A rlplatform beat --loglevel=info --schedule "$TANDEM_VAR_DIR/celerybeat-schedule" \
    >"$TANDEM_VAR_DIR/logs/beat.log" 2>&1 &
pids+=($!)
"$BIN/uvicorn" rlplatform.asgi:application --host "$HOST" --port "$PORT" \
    >"$TANDEM_VAR_DIR/logs/web.log" 2>&1 &
pids+=($!)

# The demo RL run on CPU: a short supervised warm start (so the policy
# sometimes succeeds), then GRPO in async mode; reward/mean rises within minutes.
(
    "$BIN/python" -m runtime sft examples/grpo-async.yaml --steps 35 --out "$TANDEM_VAR_DIR/runs/demo-sft" &&
    "$BIN/python" -m runtime run examples/demo.yaml "model.path=$TANDEM_VAR_DIR/runs/demo-sft" \
        "output_dir=$TANDEM_VAR_DIR/runs/{name}" metrics.progress_bar=false
) >"$TANDEM_VAR_DIR/logs/demo-run.log" 2>&1 &
pids+=($!)

cat <<MSG

  Tandem is up:   http://$HOST:$PORT/   (API docs: http://$HOST:$PORT/api/docs/)
  Log in as:      demo / demo-password  (admin of team "demo")
  Demo RL run:    tail -f $TANDEM_VAR_DIR/logs/demo-run.log
                  metrics in $TANDEM_VAR_DIR/runs/demo/metrics.jsonl
  Logs:           $TANDEM_VAR_DIR/logs/
  Stop:           Ctrl-C

MSG
wait "${pids[@]}"
