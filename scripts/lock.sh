#!/usr/bin/env bash
# Regenerate the pinned environment from pyproject.toml's ranges (docs/deploying.md, "Pinned environment"):
#   requirements-test.lock  runtime + test dependencies (scripts/setup.sh, CI)
#   requirements.lock       runtime dependencies, at the same versions (the Dockerfile)
# Exact versions with sha256 hashes, for Linux x86-64 and CPython 3.11 (the image's and CI's).
# torch is not in them: it is installed first, pinned to the CPU wheel torch==2.13.0 (TORCH_PIN).
# Run it after changing dependencies in pyproject.toml; tests/test_lock.py fails until you do.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP_TOOLS=pip-tools==7.7.0
.venv/bin/pip install -q "$PIP_TOOLS" 2>&1 | grep -v "^WARNING: Location" || true
tmp=build/lock  # a fixed path: the files' "via" notes name it
rm -rf "$tmp" && mkdir -p "$tmp"
grep -v '^#' scripts/torch.pin > "$tmp/torch.txt"
common=(--quiet --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links
        --unsafe-package torch -c "$tmp/torch.txt")
export CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh"  # what the files' header says to run
.venv/bin/pip-compile "${common[@]}" --extra test -o requirements-test.lock pyproject.toml
# The runtime set at exactly the versions the tests ran with.
sed -n 's/^\([A-Za-z0-9._-]*==[^ ;]*\).*\\$/\1/p' requirements-test.lock > "$tmp/tested.txt"
.venv/bin/pip-compile "${common[@]}" -c "$tmp/tested.txt" -o requirements.lock pyproject.toml
digest=$(.venv/bin/python scripts/lock_digest.py)
for f in requirements.lock requirements-test.lock; do
  printf '# pyproject-dependencies-sha256: %s\n' "$digest" >> "$f"
done
echo "wrote requirements.lock and requirements-test.lock ($digest)"
