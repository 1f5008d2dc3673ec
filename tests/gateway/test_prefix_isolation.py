"""The prefix cache is per tenant: no tenant can hit (or time) another tenant's cached prompts."""

from __future__ import annotations

import httpx
import pytest
from gateway_helpers import InProcessGateway, write_tenants
from kvrelay.gateway.tenants import hash_key

MODEL = "stories260K"
PROMPT = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park with her "
          "friends. One day she found a big red ball under a tree and she was very happy.")


@pytest.fixture(scope="module")
def gw(own_tmp):
    tenants = write_tenants(own_tmp / "tenants.yaml", [
        {"id": tid, "api_keys_sha256": [hash_key(f"k-{tid}")]} | ({"prefix_cache_group": "g"} if tid in "cd" else {})
        for tid in "abcd"])
    g = InProcessGateway(tenants)
    yield g
    g.stop()


def cached_tokens(gw, tenant: str, prompt: str = PROMPT, **extra) -> int:
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1} | extra,
                   headers={"x-api-key": f"k-{tenant}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_tenants_cached_prompt_is_a_miss_while_the_owner_hits(gw):
    assert cached_tokens(gw, "a") == 0
    assert cached_tokens(gw, "a") > 0  # A's repeat hits its own cache
    assert cached_tokens(gw, "b") == 0  # B sending A's prompt: no hit (and so no timing signal)
    assert cached_tokens(gw, "b") > 0
    assert cached_tokens(gw, "a", cache_salt="s1") == 0  # a request's cache_salt splits further
    assert cached_tokens(gw, "a", cache_salt="s1") > 0


def test_tenants_of_one_prefix_cache_group_share(gw):
    prompt = PROMPT.replace("Lily", "Tom")
    assert cached_tokens(gw, "c", prompt) == 0
    assert cached_tokens(gw, "d", prompt) > 0
    assert cached_tokens(gw, "a", prompt) == 0
