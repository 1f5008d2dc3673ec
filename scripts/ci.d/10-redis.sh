#!/usr/bin/env bash
# Debian's redis-server: installed if missing, one instance started on loopback:6379.
# Tests that stop and restart Redis start their own instances on free ports.
set -euo pipefail
if ! command -v redis-server >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  redis-server --bind 127.0.0.1 --port 6379 --daemonize yes --save "" --appendonly no >/dev/null
fi
redis-cli -h 127.0.0.1 -p 6379 ping
