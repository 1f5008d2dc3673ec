"""Operator-wide settings, read once from the environment at start-up (the chart sets them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrelay.operator import constants


@dataclass(frozen=True)
class OperatorConfig:
    image: str = constants.DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    default_redis_url: str | None = None  # the chart's bundled Redis, used when a spec names none
    scrape_url_templates: Mapping[str, str] = field(default_factory=lambda: dict(constants.SCRAPE_URL_TEMPLATES))
    scrape_timeout_seconds: float = constants.SCRAPE_TIMEOUT_SECONDS

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        templates = dict(constants.SCRAPE_URL_TEMPLATES)
        for role, var in constants.SCRAPE_ENV.items():
            if env.get(var):
                templates[role] = env[var]
        return cls(
            image=env.get("KVRELAY_IMAGE") or constants.DEFAULT_IMAGE,
            image_pull_policy=env.get("KVRELAY_IMAGE_PULL_POLICY") or "IfNotPresent",
            default_redis_url=env.get("KVRELAY_DEFAULT_REDIS_URL") or None,
            scrape_url_templates=templates,
            scrape_timeout_seconds=float(env.get("KVRELAY_SCRAPE_TIMEOUT_SECONDS") or constants.SCRAPE_TIMEOUT_SECONDS),
        )
