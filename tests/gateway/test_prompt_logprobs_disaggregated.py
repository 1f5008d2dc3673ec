"""Prompt logprobs through real prefill and decode worker processes, with the official `openai`
client over real HTTP: completions' `echo` + `logprobs` (lm-evaluation-harness' loglikelihood
request) and vLLM's `prompt_logprobs`, streamed and not, equal the single-process server's for
stories260K, on the inline gRPC and the shared-memory K/V planes. (`kvrelay serve --disaggregated`
runs this same backend over the same workers.)"""

from __future__ import annotations

import tempfile

import openai
import pytest
from gateway_helpers import InProcessGateway, WorkerProcess, wait_for_workers
from kvrelay.gateway.disaggregated import DisaggregatedBackend

from kvrelay.models import BUNDLED_MODEL

MODEL = "stories260K"
TEXT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park"
TOL = 1e-5


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def assert_close(got, want, where: str = "") -> None:
    """Same structure and keys, every number within TOL (None stays None)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and abs(got - want) <= TOL, f"{where}: {got} vs {want}"
    else:
        assert got == want, where


@pytest.fixture(scope="module", params=["grpc", "shm"])
def cluster(request):
    started, gw = [], None
    with tempfile.TemporaryDirectory(prefix="kvrelay-plp-") as shm_dir:
        try:
            started.append(WorkerProcess("prefill"))
            extra = ["--kv-shm-bytes", "16MiB", "--kv-shm-dir", shm_dir] if request.param == "shm" else []
            started.append(WorkerProcess("decode", *extra))
            backend = DisaggregatedBackend(started[0].address, started[1].address, str(BUNDLED_MODEL))
            gw = InProcessGateway(backend=backend)
            wait_for_workers(backend)
            yield gw, started, request.param
        finally:
            if gw is not None:
                gw.stop()
            for w in started:
                w.stop()


def _plane_bytes(decode: WorkerProcess, plane: str) -> float:
    return decode.metric(f'kvrelay:kv_plane_transfer_bytes_total{{plane="{plane}"}}')


def test_echo_logprobs_equal_the_single_process(cluster, open_gateway):
    gw, (prefill, decode), plane = cluster
    remote, local = _client(gw.url), _client(open_gateway.url)
    before, generated = _plane_bytes(decode, plane), prefill.generation_tokens()
    kwargs = {"model": MODEL, "prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0.0}
    got, want = remote.completions.create(**kwargs), local.completions.create(**kwargs)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == TEXT and got.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and all(lp.token_logprobs[1:])
    assert_close(got.choices[0].logprobs.model_dump(), want.choices[0].logprobs.model_dump(), "logprobs")
    assert _plane_bytes(decode, plane) > before  # the K/V came from the prefill worker on this plane
    assert prefill.generation_tokens() > generated  # which computed the prompt (and its first token)
    assert decode.metric('kvrelay:kv_transfer_fallbacks_total{kind="local"}') == 0

    # Streamed, with generated tokens after the prompt's.
    kwargs |= {"max_tokens": 3, "stream": True}
    got_chunks = [c.choices[0].logprobs.model_dump() for c in remote.completions.create(**kwargs) if c.choices]
    want_chunks = [c.choices[0].logprobs.model_dump() for c in local.completions.create(**kwargs) if c.choices]
    assert_close(got_chunks, want_chunks, "stream")
    assert got_chunks[0]["token_logprobs"][0] is None and len(got_chunks[0]["tokens"]) > 10


def test_vllm_prompt_logprobs_equal_the_single_process(cluster, open_gateway):
    gw, _, _ = cluster
    remote, local = _client(gw.url), _client(open_gateway.url)
    # A prompt both workers already hold in their prefix caches is still scored at every position.
    remote.completions.create(model=MODEL, prompt=TEXT, max_tokens=1)
    kwargs = {"model": MODEL, "prompt": TEXT, "max_tokens": 4, "temperature": 0.0,
              "extra_body": {"prompt_logprobs": 3}}
    got = remote.completions.create(**kwargs).choices[0].model_extra["prompt_logprobs"]
    want = local.completions.create(**kwargs).choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and all(got[1:]) and len(got) > 10
    assert_close(got, want, "prompt_logprobs")
    streamed = [c.choices[0].model_extra.get("prompt_logprobs") for c in remote.completions.create(
        **kwargs, stream=True) if c.choices]
    assert_close(streamed[0], want, "streamed")
    assert all(s is None for s in streamed[1:])

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 3,
            "temperature": 0.0, "extra_body": {"prompt_logprobs": 0}}
    assert_close(remote.chat.completions.create(**chat).choices[0].model_extra["prompt_logprobs"],
                 local.chat.completions.create(**chat).choices[0].model_extra["prompt_logprobs"], "chat")
    # n > 1 is prefilled on the decode worker, which then scores the prompt itself: the same lists.
    got = [c.model_extra["prompt_logprobs"] for c in remote.chat.completions.create(**chat, n=2).choices]
    assert_close(got, [c.model_extra["prompt_logprobs"] for c in local.chat.completions.create(**chat, n=2).choices])


def test_gateway_message_limit_is_configurable(cluster):
    """`kvrelay gateway --max-message-bytes` bounds what its decode clients read: prompt logprobs past a
    small limit are a 400 naming the field before any compute; the default limit serves them."""
    import argparse

    from kvrelay.gateway import cluster as gateway_cli

    parser = argparse.ArgumentParser()
    gateway_cli.add_arguments(parser)
    args = parser.parse_args(["--decode", "127.0.0.1:1", "--max-message-bytes", "16KiB"])
    assert args.max_message_bytes == 16 * 1024
    gw, (prefill, decode), _ = cluster
    small = DisaggregatedBackend(prefill.address, decode.address, str(BUNDLED_MODEL),
                                 max_message_bytes=args.max_message_bytes)
    limited = InProcessGateway(backend=small)
    try:
        wait_for_workers(small)
        kwargs = {"model": MODEL, "prompt": list(range(10, 110)), "max_tokens": 2, "temperature": 0.0,
                  "extra_body": {"prompt_logprobs": 20}}  # 99 scored positions x 21 entries: up to 35 KB
        computed = prefill.generation_tokens()
        with pytest.raises(openai.BadRequestError) as e:
            _client(limited.url).completions.create(**kwargs)
        assert e.value.body["param"] == "prompt_logprobs" and "100 prompt tokens" in e.value.body["message"]
        assert prefill.generation_tokens() == computed
        got = _client(gw.url).completions.create(**kwargs).choices[0].model_extra["prompt_logprobs"]
        assert len(got) == 100 and len(got[1]) >= 20
    finally:
        limited.stop()
