#!/usr/bin/env bash
# promtool (checks the gateway's /metrics exposition). Debian ships it only inside the
# `prometheus` package; installed without recommends, and its service is never started here.
set -euo pipefail
if ! command -v promtool >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  # policy-rc.d 101: keep the package's post-install from starting a Prometheus server.
  cleanup_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    cleanup_policy=1
  fi
  apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  if [ "$cleanup_policy" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi
promtool --version | head -1
