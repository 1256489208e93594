#!/usr/bin/env bash
# Throwaway PostgreSQL and Redis for tests and benchmarks (and the Prometheus binary the metrics tests scrape with).
#
#   scripts/services.sh start DIR [PG_PORT] [REDIS_PORT]   # prints export lines
#   scripts/services.sh stop DIR
#   scripts/services.sh run CMD...    # start on free ports in a temp dir, run CMD, stop
#
# Installs the Debian packages when they are missing and we are root.
# PostgreSQL refuses to run as root, so as root the cluster is owned by the
# `postgres` system user.
set -euo pipefail

log() { echo "services: $*" >&2; }

pg_bindir() {
    local d
    for d in /usr/lib/postgresql/*/bin; do
        [ -x "$d/initdb" ] && { echo "$d"; return 0; }
    done
    command -v initdb >/dev/null 2>&1 && { dirname "$(command -v initdb)"; return 0; }
    return 1
}

ensure_packages() {
    local need=()
    pg_bindir >/dev/null || need+=(postgresql)
    command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
    command -v prometheus >/dev/null 2>&1 || need+=(prometheus)  # tests/metrics_export scrapes with it
    [ ${#need[@]} -eq 0 ] && return 0
    if [ "$(id -u)" != 0 ]; then
        log "missing ${need[*]} and not root: install them or run as root"; exit 1
    fi
    log "installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1]); s.close()'
}

as_pg() {  # run a command as the cluster owner
    if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

start() {
    local dir=$1 pg_port=${2:-$(free_port)} redis_port=${3:-$(free_port)}
    ensure_packages
    local bin; bin=$(pg_bindir)
    mkdir -p "$dir"
    if [ "$(id -u)" = 0 ]; then
        id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql postgres
        chmod 755 "$dir"
        mkdir -p "$dir/pg"; touch "$dir/pg.log"; chown postgres "$dir/pg" "$dir/pg.log"
    fi
    if [ ! -f "$dir/pg/PG_VERSION" ]; then
        as_pg "$bin/initdb" -D "$dir/pg" -U tandem --auth=trust -E UTF8 >/dev/null
    fi
    as_pg "$bin/pg_ctl" -D "$dir/pg" -l "$dir/pg.log" -w -t 60 \
        -o "-p $pg_port -k $dir/pg -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=300" start >/dev/null
    as_pg "$bin/psql" -h 127.0.0.1 -p "$pg_port" -U tandem -d postgres -qtc \
        "SELECT 1 FROM pg_database WHERE datname='tandem'" | grep -q 1 \
        || as_pg "$bin/createdb" -h 127.0.0.1 -p "$pg_port" -U tandem tandem
    redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" --dir "$dir"
    echo "$pg_port" > "$dir/pg.port"; echo "$redis_port" > "$dir/redis.port"
    echo "export DATABASE_URL=postgres://tandem:tandem@127.0.0.1:$pg_port/tandem"
    echo "export REDIS_URL=redis://127.0.0.1:$redis_port/0"
}

stop() {
    local dir=$1 bin
    bin=$(pg_bindir) || true
    if [ -n "${bin:-}" ] && [ -f "$dir/pg/postmaster.pid" ]; then
        as_pg "$bin/pg_ctl" -D "$dir/pg" -m immediate stop >/dev/null 2>&1 || true
    fi
    if [ -f "$dir/redis.pid" ]; then
        kill "$(cat "$dir/redis.pid")" 2>/dev/null || true
    fi
}

run() {
    local dir; dir=$(mktemp -d /tmp/tandem-services.XXXXXX)
    # shellcheck disable=SC2064
    trap "stop '$dir'; rm -rf '$dir'" EXIT
    eval "$(start "$dir")"
    log "PostgreSQL $DATABASE_URL, Redis $REDIS_URL"
    "$@"
}

cmd=${1:-}; shift || true
case "$cmd" in
    start) start "$@" ;;
    stop) stop "$@" ;;
    run) run "$@" ;;
    *) echo "usage: $0 start DIR [PG_PORT] [REDIS_PORT] | stop DIR | run CMD..." >&2; exit 2 ;;
esac
