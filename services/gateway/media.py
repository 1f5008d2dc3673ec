"""Getting a chat request's images: `data:` URLs decoded, http(s) URLs fetched, within limits.

The limits are the server's flags (vLLM's where it has one):
- `--limit-mm-per-prompt '{"image": N}'`: images in one request (default 8);
- `--max-image-bytes`: bytes of one image, encoded (default 20 MiB, OpenAI's limit);
- `--media-fetch-timeout`: seconds to fetch one image URL (default 10);
- `--allowed-media-domains`: the only hosts image URLs may name (default: any, as vLLM). Redirects
  are not followed, so a listed host cannot hand the fetch to an unlisted one. A server that callers
  it does not trust can reach should set it: the fetch runs from inside the cluster (SSRF).
Each failure is a 400 naming the content part at fault, and nothing is scheduled. The request body
itself stays under `--max-body-bytes`, whose default is 32 MiB for a vision-language model (2 MiB
for a text model): room for photos as data URLs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from kvrelay.gateway import errors


@dataclass(frozen=True)
class MediaLimits:
    max_images: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    fetch_timeout_s: float = 10.0
    allowed_domains: tuple[str, ...] | None = None  # None: any host


def parse_limit_mm_per_prompt(value: str | None) -> int:
    """--limit-mm-per-prompt's JSON ({"image": N}) -> N; ValueError saying what is wrong."""
    import json

    if value is None:
        return MediaLimits.max_images
    try:
        limits = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--limit-mm-per-prompt: not JSON ({e}); e.g. '{{\"image\": 4}}'") from e
    if not isinstance(limits, dict) or set(limits) - {"image"}:
        raise ValueError("--limit-mm-per-prompt: an object with the key 'image' (the only modality served), "
                         "e.g. '{\"image\": 4}'")
    n = limits.get("image", MediaLimits.max_images)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"--limit-mm-per-prompt: image must be a non-negative integer, got {n!r}")
    return n


def _data_url(url: str, field: str, limit: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise errors.bad_request(f"{field}: a data URL must be base64: data:image/<type>;base64,<data>", field)
    if len(payload) * 3 // 4 > limit:
        raise errors.bad_request(f"{field}: the image is over {limit} bytes (--max-image-bytes)", field)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise errors.bad_request(f"{field}: the data URL's base64 does not decode: {e}", field) from e


async def _fetch(client: httpx.AsyncClient, url: str, field: str, limits: MediaLimits) -> bytes:
    host = urlsplit(url).hostname or ""
    if limits.allowed_domains is not None and host not in limits.allowed_domains:
        raise errors.bad_request(f"{field}: host {host!r} is not among the allowed media domains "
                                 "(--allowed-media-domains)", field)
    body = bytearray()
    try:
        async with asyncio.timeout(limits.fetch_timeout_s), client.stream("GET", url) as r:
            if r.status_code != 200:
                raise errors.bad_request(f"{field}: fetching the image answered HTTP {r.status_code}", field)
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > limits.max_image_bytes:
                    raise errors.bad_request(f"{field}: the image is over {limits.max_image_bytes} bytes "
                                             "(--max-image-bytes)", field)
    except TimeoutError as e:
        raise errors.bad_request(f"{field}: fetching the image took over {limits.fetch_timeout_s} s "
                                 "(--media-fetch-timeout)", field) from e
    except httpx.HTTPError as e:
        raise errors.bad_request(f"{field}: fetching the image failed: {e!r}", field) from e
    return bytes(body)


async def load_images(parts: list[tuple[str, str]], limits: MediaLimits, client: httpx.AsyncClient) -> list[bytes]:
    """Each (field, url)'s encoded image, in order, fetched concurrently."""
    if len(parts) > limits.max_images:
        raise errors.bad_request(f"messages: {len(parts)} images, more than the {limits.max_images} a request may "
                                 "hold (--limit-mm-per-prompt)", "messages")

    async def one(field: str, url: str) -> bytes:
        scheme = urlsplit(url).scheme.lower()
        if scheme == "data":
            return _data_url(url, field, limits.max_image_bytes)
        if scheme in ("http", "https"):
            return await _fetch(client, url, field, limits)
        raise errors.bad_request(f"{field}: image URLs must be data: or http(s): URLs, got {scheme or 'none'!r}",
                                 field)

    return list(await asyncio.gather(*(one(f, u) for f, u in parts)))
