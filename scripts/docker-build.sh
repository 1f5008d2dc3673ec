#!/usr/bin/env bash
# Build the image with its version labels filled in: kvrelay's version, the git commit, the torch
# wheel, and the sha256 of requirements.lock (the exact versions of everything else).
#   bash scripts/docker-build.sh -t registry.example.com/kvrelay:0.1.0 [more docker build args]
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)
torch=$(sed -n 's/^torch==//p' scripts/torch.pin)
exec docker build \
  --build-arg KVRELAY_VERSION="$version" \
  --build-arg TORCH_VERSION="$torch" \
  --build-arg LOCK_SHA256="$(sha256sum requirements.lock | cut -d' ' -f1)" \
  --build-arg GIT_COMMIT="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
  "$@" .
