"""The few Kubernetes API calls the operator makes, over kopf's authenticated HTTP client.

kopf has no server-side-apply helper, so this module issues the PATCH requests itself through
kopf's request function: it reuses kopf's login (kubeconfig, service account), its
re-authentication on 401 and its retries. kopf's client lives in a private module; this file
is the only place that touches it (kopf is pinned below 2 in pyproject.toml).
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from kopf._cogs.clients import api, errors
from kopf._cogs.configs.configuration import OperatorSettings
from kvrelay.operator import constants as c

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is valid YAML
MERGE_CONTENT_TYPE = "application/merge-patch+json"

KIND_PATHS = {
    ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{namespace}/deployments",
    ("v1", "Service"): "/api/v1/namespaces/{namespace}/services",
    ("v1", "ConfigMap"): "/api/v1/namespaces/{namespace}/configmaps",
    ("v1", "Secret"): "/api/v1/namespaces/{namespace}/secrets",
    (c.API_VERSION, c.KIND): f"/apis/{c.API_VERSION}/namespaces/{{namespace}}/{c.PLURAL}",
    (c.LWS_API_VERSION, c.LWS_KIND): f"/apis/{c.LWS_API_VERSION}/namespaces/{{namespace}}/{c.LWS_PLURAL}",
}

NotFound = errors.APINotFoundError
APIError = errors.APIError


def object_path(api_version: str, kind: str, namespace: str, name: str) -> str:
    try:
        collection = KIND_PATHS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator manages no {kind} of {api_version}") from None
    return f"{collection.format(namespace=namespace)}/{name}"


def peering_path(name: str) -> str:
    return f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}"


def path_of(obj: Mapping[str, Any]) -> str:
    meta = obj["metadata"]
    return object_path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])


class KubeClient:
    """Thin wrapper so handlers read as what they do; one per operator."""

    def __init__(self, settings: OperatorSettings, logger: logging.Logger | logging.LoggerAdapter):
        self.settings = settings
        self.logger = logger

    async def get(self, path: str, backoffs: Iterable[float] | None = None) -> dict[str, Any] | None:
        """The object, or None when it does not exist. backoffs: the retries' waits (kopf's
        networking.error_backoffs when None; kopf retries 403s and 5xx)."""
        try:
            response = await api.request("get", path, settings=self.settings, backoffs=backoffs, logger=self.logger)
            async with response:
                return await response.json()
        except errors.APINotFoundError:
            return None

    async def apply(self, obj: Mapping[str, Any], field_manager: str = c.FIELD_MANAGER) -> dict[str, Any]:
        """Server-side apply (creates the object when missing); force takes over conflicting fields."""
        query = urllib.parse.urlencode({"fieldManager": field_manager, "force": "true"})
        return await api.patch(
            f"{path_of(obj)}?{query}",
            payload=json.loads(json.dumps(obj)),
            headers={"Content-Type": APPLY_CONTENT_TYPE},
            settings=self.settings,
            logger=self.logger,
        )

    async def create_once(self, obj: Mapping[str, Any]) -> bool:
        """POST obj; an object of that name already there is left as it is. True when created."""
        meta = obj["metadata"]
        collection = KIND_PATHS[(obj["apiVersion"], obj["kind"])].format(namespace=meta["namespace"])
        try:
            await api.post(collection, payload=json.loads(json.dumps(obj)), settings=self.settings,
                           logger=self.logger)
        except errors.APIConflictError:
            return False
        return True

    async def api_served(self, group_version: str) -> bool:
        """Whether the API server serves group/version (its CRD is installed): API discovery, which
        every authenticated client may read."""
        return await self.get(f"/apis/{group_version}", backoffs=[]) is not None

    async def merge_patch(self, path: str, patch: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        query = urllib.parse.urlencode({"fieldManager": field_manager})
        return await api.patch(
            f"{path}?{query}",
            payload=dict(patch),
            headers={"Content-Type": MERGE_CONTENT_TYPE},
            settings=self.settings,
            logger=self.logger,
        )
