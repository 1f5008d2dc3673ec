"""Test harness: a Kubernetes API emulator (kmock) that behaves enough like a real API server.

kmock 0.8 stores objects and streams watch events, but assigns no uid, resourceVersion,
generation or timestamps, ignores generateName, does not create objects on server-side apply and
has no garbage collector. `Cluster` fills in exactly those gaps, nothing more.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import secrets
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonpatch
import kmock
from kmock._internal import dicts, enums
from kvrelay.operator import constants as c

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "charts" / "kvrelay" / "crds" / "inferenceservices.kvrelay.dev.yaml"
EXAMPLE_PATH = ROOT / "examples" / "inferenceservice.yaml"

ISVC = kmock.resource(group=c.GROUP, version=c.VERSION, plural=c.PLURAL)
DEPLOYMENTS = kmock.resource(group="apps", version="v1", plural="deployments")
SERVICES = kmock.resource(group="", version="v1", plural="services")
CONFIGMAPS = kmock.resource(group="", version="v1", plural="configmaps")
EVENTS = kmock.resource(group="", version="v1", plural="events")
APPLY = "application/apply-patch+yaml"


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


class Cluster(kmock.KubernetesEmulator):
    """kmock's emulator plus the API server's bookkeeping and a garbage collector."""

    _versions = itertools.count(1)

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None:
            if request.action == enums.action.CREATE and isinstance(request.data, dict):
                self._fill_new(request.data, request.namespace)
            elif request.action == enums.action.UPDATE and isinstance(request.data, list):  # JSON patch
                request.data.append({"op": "replace", "path": "/metadata/resourceVersion",
                                     "value": str(next(self._versions))})
            elif request.action == enums.action.UPDATE and isinstance(request.data, dict):
                await self._prepare_patch(request)
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:  # the API server's answer to a stale resourceVersion
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from e
        finally:
            if request.resource is not None and request.action in (enums.action.UPDATE, enums.action.DELETE):
                await self._collect_garbage()

    def _fill_new(self, data: dict[str, Any], namespace: str | None) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if namespace and not meta.get("namespace"):
            meta["namespace"] = namespace
        meta.setdefault("uid", str(uuid.uuid4()))
        meta["resourceVersion"] = str(next(self._versions))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp", now_iso())

    async def _prepare_patch(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        data = request.data
        async with self._lock:
            exists = key in self.objects and not self.objects[key].deleted
            if not exists and request.headers.get("Content-Type", "").startswith(APPLY):
                # Server-side apply creates what is missing.
                created = copy.deepcopy(data)
                self._fill_new(created, request.namespace)
                self.objects[key] = created
                await self._buses[request.resource].put({"type": "ADDED", "object": self.objects[key].raw})
                exists = True
            if not exists:
                return
            old = self.objects[key].raw
            meta = data.setdefault("metadata", {})
            meta["resourceVersion"] = str(next(self._versions))
            if request.subresource is None and "spec" in data:
                new = dicts.patch_dict(copy.deepcopy(old), data)
                if new.get("spec") != old.get("spec"):
                    meta["generation"] = int(old.get("metadata", {}).get("generation", 1)) + 1

    async def _collect_garbage(self) -> None:
        """Delete objects whose owners are all gone (the cluster's garbage collector)."""
        async with self._lock:
            while True:
                live = {key: obj for key, obj in self.objects.items() if not obj.deleted}
                uids = {obj.raw.get("metadata", {}).get("uid") for obj in live.values()}
                orphans = [
                    key for key, obj in live.items()
                    if (refs := obj.raw.get("metadata", {}).get("ownerReferences"))
                    and not any(ref.get("uid") in uids for ref in refs)
                ]
                if not orphans:
                    return
                for key in orphans:
                    raw = self.objects[key].raw
                    self.objects[key].delete()
                    await self._buses[key[0]].put({"type": "DELETED", "object": raw})

    # Helpers for tests.
    def live(self, resource: kmock.resource, namespace: str, name: str) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST an object through the API, as kubectl would."""
        meta = body["metadata"]
        group, _, version = body["apiVersion"].rpartition("/")
        plural = body["kind"].lower() + "s"
        prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
        async with self.post(f"{prefix}/namespaces/{meta['namespace']}/{plural}", json=body) as response:
            assert response.status < 300, await response.text()
            return await response.json()

    async def patch_object(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.patch(path, json=patch, headers=headers) as response:
            assert response.status < 300, await response.text()
            return await response.json()

    async def delete_object(self, path: str) -> None:
        async with self.delete(path) as response:
            assert response.status < 300, await response.text()

    def writes(self, *resources: kmock.resource) -> list[kmock.Request]:
        return [r for r in list(self._requests) if r.method in ("POST", "PATCH", "PUT", "DELETE")
                and r.resource in resources]


def isvc_body(name: str = "demo", namespace: str = "default", **spec: Any) -> dict[str, Any]:
    body_spec: dict[str, Any] = {"model": {"uri": "/models/stories260K"},
                                 "autoscaling": {"intervalSeconds": 1}}
    body_spec.update(spec)
    return {"apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": body_spec}


async def eventually(check: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1) -> Any:
    """Poll `check` until it returns a truthy value (without blocking the emulator's loop)."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            last = check()
            if last:
                return last
        except (KeyError, TypeError, IndexError, AssertionError) as e:
            last = e
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s; last: {last!r}")
