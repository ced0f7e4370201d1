#!/usr/bin/env bash
# Start a throwaway PostgreSQL server on 127.0.0.1 for the distributed-tuning tests (CI and local).
# Prints the storage URL to use. Idempotent: an already running server on the port is reused (stderr
# says "reused"; "started" when this call started it).
# Usage: bash scripts/start_postgres.sh [port]        (installs Debian's postgresql first if it is missing)
#        bash scripts/start_postgres.sh stop [port]   (stops the server of that port's data folder, if running)
# The data folder is $BOLE_TUNE_PG_DATA, else /tmp/bole-tune-pg-PORT; it is kept after a stop.
set -euo pipefail
ACTION=start
if [ "${1:-}" = stop ]; then ACTION=stop; shift; fi
PORT=${1:-55432}
DATA=${BOLE_TUNE_PG_DATA:-/tmp/bole-tune-pg-$PORT}
URL="postgresql://postgres@127.0.0.1:$PORT/bole_tune"
BIN=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1 || true)
run() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
if [ "$ACTION" = stop ]; then
  if [ -n "$BIN" ] && [ -s "$DATA/postmaster.pid" ]; then
    run "$BIN/pg_ctl" -D "$DATA" -m fast -w stop >/dev/null
    echo "stopped the server in $DATA" >&2
  fi
  exit 0
fi
if [ -z "$BIN" ]; then
  (apt-get install -y -q postgresql >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q postgresql >/dev/null; })
  BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
fi
if run "$BIN/pg_isready" -h 127.0.0.1 -p "$PORT" -q 2>/dev/null; then
  echo "reused the server already running on port $PORT" >&2
  echo "$URL"; exit 0
fi
if [ ! -s "$DATA/PG_VERSION" ]; then
  mkdir -p "$DATA"
  [ "$(id -u)" = 0 ] && chown postgres "$DATA"
  run "$BIN/initdb" -D "$DATA" -U postgres --auth=trust -E UTF8 >/dev/null
fi
run "$BIN/pg_ctl" -D "$DATA" -o "-p $PORT -k /tmp -c listen_addresses=127.0.0.1 -c max_connections=200" \
  -l "$DATA/server.log" -w start >/dev/null
run "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres bole_tune 2>/dev/null || true
echo "started a server on port $PORT (data in $DATA; stop: bash scripts/start_postgres.sh stop $PORT)" >&2
echo "$URL"
