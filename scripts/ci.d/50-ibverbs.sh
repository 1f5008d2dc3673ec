#!/usr/bin/env bash
# Debian's libibverbs1: the Mooncake transfer engine (kvrelay.kvtransfer.mooncake) needs it to
# import, even for its TCP protocol, which the tests use on loopback.
set -euo pipefail
if ! ldconfig -p | grep -q "libibverbs.so.1 "; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null
fi
ldconfig -p | grep "libibverbs.so.1 "
