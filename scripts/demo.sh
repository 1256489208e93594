#!/usr/bin/env bash
# `make demo`: the platform with embedded defaults (SQLite, in-process channel
# layer, a local Celery worker on a filesystem broker), a demo admin, a local
# CPU resource group, and a demo RL run submitted to it and launched on this CPU.
#
# Ctrl-C (or SIGINT/SIGTERM/SIGHUP to this script) stops everything within 15 s, in order: the demo
# run's warm start, beat and the worker (this host's agent: it marks the host offline), then the role
# processes while the web server still takes their last reports, then the web server.
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
# /metrics' multiprocess files of an earlier start must not count again (before any process starts).
"$BIN/python" manage.py reset_metrics_dir >/dev/null
"$BIN/python" manage.py demo_setup

# Seconds each stage of the stop may take before what is left of it is killed, 14 s in all: the worker
# takes about 5 s (rlplatform.shutdown), a role process with the platform still up one or two.
WORKER_STOP_S=9
ROLES_STOP_S=3
WEB_STOP_S=2  # uvicorn's own bound on open WebSockets and long-polls

# Whether any process of the process groups given (PGIDs) is still running; a zombie (ended, its parent has
# not collected it yet) is not.
running() {
    ps -A -o pgid=,stat= | awk -v groups=" $* " 'index(groups, " " $1 " ") && $2 !~ /^Z/ { found = 1 }
        END { exit !found }'
}

# Wait up to $2 seconds for the process groups given to end; SIGKILL what is left of them ($1 names them).
stop_within() {
    local what=$1 seconds=$2 tenths=0 group
    shift 2
    while running "$@" && [ "$tenths" -lt $((seconds * 10)) ]; do
        sleep 0.1
        tenths=$((tenths + 1))
    done
    if running "$@"; then
        echo "demo: $what still running after ${seconds} s: killed" >&2
        for group in "$@"; do
            kill -KILL -- "-$group" 2>/dev/null || true
        done
    fi
}

# The process groups of this demo's role processes that have not ended: jobs/rolewrap.py (a session
# leader) writes its pid, and its role's exit code once the role has ended. A pid the system has since
# given to another process is not this role's: the wrapper's command line names its role directory.
live_role_groups() {
    local pidfile dir pid
    for pidfile in "$TANDEM_CHECKPOINT_ROOT"/run-*/roles/*/attempt-*/pid; do
        dir=${pidfile%/pid}
        [ -f "$pidfile" ] && [ ! -f "$dir/exit_code" ] || continue
        pid=$(cat "$pidfile")
        ps -o args= -p "$pid" 2>/dev/null | grep -qF -- "$dir" && echo "$pid"
    done
    return 0
}

worker= beat= web= demo_run= stopping=
stop_demo() {
    [ -z "$stopping" ] && [ -n "$worker" ] || return 0
    stopping=1
    trap '' INT TERM HUP  # one orderly stop, bounded above: a second Ctrl-C does not cut it short
    # The host agent first: once the worker has exited, nothing on this host starts a role process (its
    # supervisor restarts a role that ends while it runs). To its main process only, which stops its pool.
    local others=($beat $demo_run) group  # the parts started so far
    for group in "${others[@]}"; do
        kill -TERM -- "-$group" 2>/dev/null || true
    done
    kill -TERM "$worker" 2>/dev/null || true
    stop_within "the worker, beat or the demo run" "$WORKER_STOP_S" "$worker" "${others[@]}"
    # Role processes outlive a worker on purpose (a restarted worker adopts them); the demo ends them too.
    local roles
    roles=$(live_role_groups)
    if [ -n "$roles" ]; then
        for group in $roles; do
            kill -TERM -- "-$group" 2>/dev/null || true
        done
        # shellcheck disable=SC2086 # one argument per process group
        stop_within "role processes" "$ROLES_STOP_S" $roles
    fi
    if [ -n "$web" ]; then
        kill -TERM "$web" 2>/dev/null || true
        stop_within "the web server" "$WEB_STOP_S" "$web"
    fi
    wait 2>/dev/null || true
}
trap 'stop_demo; exit 130' INT
trap 'stop_demo; exit 143' TERM
trap 'stop_demo; exit 129' HUP
trap stop_demo EXIT

# Each part gets a process group of its own (job control on while they start), so a Ctrl-C reaches this
# script alone and stop_demo ends each part with whatever it started, in order.
set -m

# The worker is this machine's host agent: it registers host "local" (queue host.local) and starts the
# role processes of admitted runs there.
TANDEM_HOST_NAME=local TANDEM_HOST_GROUP=local-cpu TANDEM_HOST_DEVICE_KIND=cpu TANDEM_HOST_ADDRESS=127.0.0.1 \
    "$BIN/celery" -A rlplatform worker --loglevel=info --concurrency=2 --queues=default \
    >"$TANDEM_VAR_DIR/logs/worker.log" 2>&1 &
worker=$!
"$BIN/celery" -A rlplatform beat --loglevel=info --schedule "$TANDEM_VAR_DIR/celerybeat-schedule" \
    >"$TANDEM_VAR_DIR/logs/beat.log" 2>&1 &
beat=$!
"$BIN/uvicorn" rlplatform.asgi:application --host "$HOST" --port "$PORT" --timeout-graceful-shutdown "$WEB_STOP_S" \
    >"$TANDEM_VAR_DIR/logs/web.log" 2>&1 &
web=$!

# The demo RL run: a deliberately weak supervised warm start on the demo's own task (30 steps: it
# answers few held-out prompts, and sometimes one when sampled), then the GRPO run is submitted to the
# platform, which launches it on this host; eval/accuracy rises from near 0 to about 0.5 within a
# minute or two (bench/RESULTS.md, "Demo learning"). The warm start's directory names its recipe, so an
# older demo's warm start under var/models is not reused.
WARM_START=$TANDEM_SHARED_MODEL_ROOT/demo-sft-30
(
    if [ ! -f "$WARM_START/config.json" ]; then
        "$BIN/python" -m runtime sft --steps 30 --out "$WARM_START" examples/demo.yaml model.path=null
    fi &&
    "$BIN/python" manage.py demo_submit examples/demo.yaml "model.path=$WARM_START" --base-url "http://$HOST:$PORT"
) >"$TANDEM_VAR_DIR/logs/demo-run.log" 2>&1 &
demo_run=$!
set +m

cat <<MSG

  Tandem is up:   http://$HOST:$PORT/   (API docs: http://$HOST:$PORT/api/docs/)
  Log in as:      demo / demo-password  (admin of team "demo")
  Demo RL run:    warm start, then submitted to the platform (its URL: $TANDEM_VAR_DIR/logs/demo-run.log);
                  watch it at http://$HOST:$PORT/ (experiment "demo"); files in $TANDEM_VAR_DIR/runs/run-<id>/
  Logs:           $TANDEM_VAR_DIR/logs/
  Stop:           Ctrl-C

MSG
wait "$worker" "$beat" "$web" "$demo_run"
