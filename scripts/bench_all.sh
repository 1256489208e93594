#!/usr/bin/env bash
# Every benchmark in one go (pass --quick for the under-a-minute versions).
# Needs DATABASE_URL (PostgreSQL) and REDIS_URL for the platform benchmarks:
# `make bench-quick` runs this under scripts/services.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
mkdir -p var/bench
for script in engine logprob_memory optimizer_step train_layout lora telemetry rollout_scheduling transfer remote_rollout pipeline startup async_memory learning_curve gym api_load ingest fanout launch longpoll cancel_queue metrics_endpoint; do
    echo "== bench/$script.py $*"
    "$BIN/python" "bench/$script.py" "$@" | tee "var/bench/$script.log"
done
