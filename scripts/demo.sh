#!/usr/bin/env bash
# `make demo`: the platform with embedded defaults (SQLite, in-process channel
# layer, a local Celery worker on a filesystem broker), a demo admin, a local
# CPU resource group, and a demo RL run submitted to it and launched on this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
export TANDEM_VAR_DIR=${TANDEM_VAR_DIR:-$PWD/var}
export DEBUG=${DEBUG:-true}
export TANDEM_PLATFORM_URL=${TANDEM_PLATFORM_URL:-http://$HOST:$PORT}  # where role processes report
export TANDEM_CHECKPOINT_ROOT=${TANDEM_CHECKPOINT_ROOT:-$TANDEM_VAR_DIR/runs}
export TANDEM_SHARED_MODEL_ROOT=${TANDEM_SHARED_MODEL_ROOT:-$TANDEM_VAR_DIR/models}  # specs may read the warm start here
mkdir -p "$TANDEM_VAR_DIR/logs"

"$BIN/python" manage.py migrate --noinput >/dev/null
"$BIN/python" manage.py demo_setup

pids=()
cleanup() {
    kill "${pids[@]}" 2>/dev/null || true
    # Role processes outlive a worker on purpose (a restarted worker adopts them); the demo ends them too.
    for pidfile in "$TANDEM_CHECKPOINT_ROOT"/run-*/roles/*/attempt-*/pid; do
        [ -f "$pidfile" ] && kill -- "-$(cat "$pidfile")" 2>/dev/null || true
    done
    wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

# The worker is this machine's host agent: it registers host "local" (queue host.local) and starts the
# role processes of admitted runs there.
TANDEM_HOST_NAME=local TANDEM_HOST_GROUP=local-cpu TANDEM_HOST_DEVICE_KIND=cpu TANDEM_HOST_ADDRESS=127.0.0.1 \
    "$BIN/celery" -A rlplatform worker --loglevel=info --concurrency=2 --queues=default \
    >"$TANDEM_VAR_DIR/logs/worker.log" 2>&1 &
pids+=($!)
"$BIN/celery" -A rlplatform beat --loglevel=info --schedule "$TANDEM_VAR_DIR/celerybeat-schedule" \
    >"$TANDEM_VAR_DIR/logs/beat.log" 2>&1 &
pids+=($!)
"$BIN/uvicorn" rlplatform.asgi:application --host "$HOST" --port "$PORT" \
    >"$TANDEM_VAR_DIR/logs/web.log" 2>&1 &
pids+=($!)

# The demo RL run: a short supervised warm start (so the policy sometimes succeeds), then the GRPO run
# is submitted to the platform, which launches it on this host; reward/mean rises within minutes.
(
    if [ ! -f "$TANDEM_SHARED_MODEL_ROOT/demo-sft/config.json" ]; then
        "$BIN/python" -m runtime sft examples/grpo-async.yaml --steps 35 --out "$TANDEM_SHARED_MODEL_ROOT/demo-sft"
    fi &&
    "$BIN/python" manage.py demo_submit examples/demo.yaml "model.path=$TANDEM_SHARED_MODEL_ROOT/demo-sft" \
        --base-url "http://$HOST:$PORT"
) >"$TANDEM_VAR_DIR/logs/demo-run.log" 2>&1 &
pids+=($!)

cat <<MSG

  Tandem is up:   http://$HOST:$PORT/   (API docs: http://$HOST:$PORT/api/docs/)
  Log in as:      demo / demo-password  (admin of team "demo")
  Demo RL run:    warm start, then submitted to the platform (its URL: $TANDEM_VAR_DIR/logs/demo-run.log);
                  watch it at http://$HOST:$PORT/ (experiment "demo"); files in $TANDEM_VAR_DIR/runs/run-<id>/
  Logs:           $TANDEM_VAR_DIR/logs/
  Stop:           Ctrl-C

MSG
wait "${pids[@]}"
