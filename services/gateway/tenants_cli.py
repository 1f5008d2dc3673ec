"""`kvrelay tenants add NAME`: add a tenant with a new API key to a tenants file.

The key is printed once, on stdout; only its sha256 goes into the file (see tenants.py for
the format and docs/tenants.md). The file is validated as the gateway would read it and
replaced atomically, so a running gateway picks the tenant up at its next reload. The YAML
is rewritten, so comments in it are not kept.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
from pathlib import Path

import yaml
from kvrelay.gateway.tenants import TenantConfigError, hash_key, parse_tenants

KEY_PREFIX = "sk-kvrelay-"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tenants_command", required=True)
    add = sub.add_parser("add", help="add a tenant with a new API key (printed once)")
    add.add_argument("name", help="tenant id (used in quotas, metrics and logs; not secret)")
    add.add_argument("--file", default="tenants.yaml", help="tenants file to create or extend (default: %(default)s)")
    add.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    add.add_argument("--tpm", type=int, default=None, help="tokens per minute (default: unlimited)")
    add.add_argument("--tpd", type=int, default=None, help="tokens per day (default: unlimited)")
    add.add_argument("--concurrency", type=int, default=None, help="concurrent requests (default: unlimited)")
    add.add_argument("--priority", type=int, default=0, help="higher is served first (default: 0)")
    add.add_argument("--models", default="*", help="comma-separated model ids it may use (default: all)")
    add.add_argument("--prefix-cache-group", default=None,
                     help="share cached prompt prefixes with the tenants of this group (default: its own cache)")


def add_tenant(path: Path, name: str, quotas: dict[str, int], priority: int = 0, models: list[str] | None = None,
               prefix_cache_group: str | None = None) -> str:
    """Append a tenant with a new key to `path` (created if missing); returns the key."""
    doc = {"tenants": []}
    if path.exists():
        doc = yaml.safe_load(path.read_text()) or {"tenants": []}
    parse_tenants(doc, str(path))  # refuse to extend a file the gateway would not load
    if any(isinstance(t, dict) and t.get("id") == name for t in doc["tenants"]):
        raise TenantConfigError(f"{path}: tenant {name!r} already exists")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry: dict = {"id": name, "api_keys_sha256": [hash_key(key)], "priority": priority,
                   "allowed_models": models or ["*"]}
    if quotas:
        entry["quotas"] = quotas
    if prefix_cache_group:
        entry["prefix_cache_group"] = prefix_cache_group
    doc["tenants"].append(entry)
    parse_tenants(doc, str(path))
    fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(doc, f, sort_keys=False)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return key


def run(args: argparse.Namespace) -> int:
    quotas = {name: value for name, value in (("requests_per_minute", args.rpm), ("tokens_per_minute", args.tpm),
                                              ("concurrent_requests", args.concurrency),
                                              ("tokens_per_day", args.tpd)) if value is not None}
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    try:
        key = add_tenant(Path(args.file), args.name, quotas, args.priority, models, args.prefix_cache_group)
    except (OSError, TenantConfigError, yaml.YAMLError) as e:
        print(f"kvrelay tenants add: {e}", file=sys.stderr)
        return 1
    print(key)
    print(f"added tenant {args.name!r} to {args.file}; the key above is shown once: store it now "
          "(send it as `Authorization: Bearer <key>`)", file=sys.stderr)
    return 0
