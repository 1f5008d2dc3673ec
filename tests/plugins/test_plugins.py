"""Plugins end to end: examples/plugins is pip-installed into this environment, and each of its
entry points is driven through the real path that uses it: an architecture through the engine
(parity with transformers), a logits processor and a gateway hook through HTTP with the openai
client, a routing policy through the cluster gateway's backend, a K/V transport through a real
prefill/decode hand-off."""

from __future__ import annotations

import importlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1]
for sub in ("engine", "gateway", "workers"):  # the shared helpers of those suites
    sys.path.insert(0, str(TESTS / sub))

from gateway_helpers import InProcessGateway
from helpers import PROMPTS, hf_greedy, make_engine
from kvrelay.engine import architectures

from kvrelay import plugins

EXAMPLE = TESTS.parent / "examples" / "plugins"
DIST = "kvrelay-example-plugins"


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    import shutil

    copy = tmp_path_factory.mktemp("example") / "plugins"  # the build leaves its outputs there, not in the tree
    shutil.copytree(EXAMPLE, copy, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    _pip("install", "-q", "--no-deps", "--no-build-isolation", str(copy))
    importlib.invalidate_caches()
    plugins.reset_for_tests()
    try:
        yield plugins.load_plugins(DIST)
    finally:
        _pip("uninstall", "-q", "-y", DIST)
        importlib.invalidate_caches()
        plugins.reset_for_tests()
        architectures.unregister("ExampleLlamaForCausalLM")


def test_every_group_loads_and_the_log_lists_them(installed, caplog):
    assert {g: sorted(p) for g, p in installed.items()} == {
        "kvrelay.architectures": ["example-llama"],
        "kvrelay.logits_processors": ["ban_tokens"],
        "kvrelay.routing": ["round_robin"],
        "kvrelay.kv_transports": ["counting"],
        "kvrelay.gateway_hooks": ["audit"],
    }
    assert "ExampleLlamaForCausalLM" in architectures.supported()
    plugins.reset_for_tests()
    with caplog.at_level(logging.INFO, logger="kvrelay.plugins"):
        plugins.load_plugins("ban_tokens")  # by entry-point name: only that one
    assert "plugins loaded: logits_processors:ban_tokens (kvrelay-example-plugins 0.1.0)" in caplog.text
    plugins.reset_for_tests()
    with pytest.raises(plugins.PluginError, match=r"names \['no-such-plugin'\]"):
        plugins.load_plugins("no-such-plugin")
    plugins.reset_for_tests()
    plugins.load_plugins(DIST)


def test_a_failing_import_stops_start_up_naming_the_plugin(installed, tmp_path):
    # A second distribution whose entry point cannot import, found on PYTHONPATH by a fresh process.
    dist = tmp_path / "broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvrelay.routing]\nbroken = no_such_module:Policy\n")
    dup = tmp_path / "dup_plugin-1.0.dist-info"
    code = "from kvrelay.plugins import load_plugins; load_plugins()"
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "plugin 'broken' (kvrelay.routing, no_such_module:Policy, from broken-plugin 1.0) failed to import" in out.stderr
    # The same name twice in a group: both distributions are named.
    (dist / "entry_points.txt").write_text("")
    dup.mkdir()
    (dup / "METADATA").write_text("Metadata-Version: 2.1\nName: dup-plugin\nVersion: 1.0\n")
    (dup / "entry_points.txt").write_text("[kvrelay.routing]\nround_robin = kvrelay_example_plugins.routing:RoundRobin\n")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert "plugin 'round_robin' in group kvrelay.routing is provided twice" in out.stderr
    assert "dup-plugin 1.0" in out.stderr and "kvrelay-example-plugins 0.1.0" in out.stderr


def _greedy_with_embedding_multiplier(model_dir: Path, prompt_ids: list[int], n: int, multiplier: float):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            embeds = model.model.embed_tokens(torch.tensor([ids])) * multiplier
            ids.append(int(model(inputs_embeds=embeds).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_architecture_plugin_serves_its_variant(installed, tmp_path):
    from kvrelay.engine.sampling_params import SamplingParams
    from pd_helpers import save_tiny_llama

    d = save_tiny_llama(tmp_path / "example")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"architectures": ["ExampleLlamaForCausalLM"],
                                                        "embedding_multiplier": 1.5}))
    engine = make_engine(d)
    assert engine.config.architecture == "ExampleLlamaForCausalLM" and engine.config.embed_scale == 1.5
    prompt = engine.tokenizer.encode_prompt(PROMPTS[3])
    engine.add_request(prompt, SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0), "x")
    got = []
    while engine.has_work():
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert got == _greedy_with_embedding_multiplier(d, prompt, 12, 1.5)
    (d / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaForCausalLM"]}))
    assert got != hf_greedy(str(d), tuple(prompt), 12)  # the multiplier made a difference


@pytest.fixture(scope="module")
def gateway(installed, tmp_path_factory):
    import os

    log = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    os.environ["KVRELAY_AUDIT_LOG"] = str(log)
    gw = InProcessGateway()
    try:
        yield gw, log
    finally:
        gw.stop()
        os.environ.pop("KVRELAY_AUDIT_LOG", None)


def test_logits_processor_by_name_in_the_request(gateway):
    import openai

    gw, _ = gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none")
    model = gw.gateway.backend.model_name
    tok = gw.engine.tokenizer
    prompt_ids = tok.encode_prompt("Once upon a time")
    plain = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.0)
    banned = tok.encode_prompt("Once upon a time" + plain.choices[0].text)[len(prompt_ids):][:1]  # the greedy pick
    out = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0.0,
                                    extra_body={"logits_processors": {"ban_tokens": {"token_ids": banned}}})
    assert out.choices[0].text != plain.choices[0].text
    assert tok.encode_prompt("Once upon a time" + out.choices[0].text)[len(prompt_ids)] not in banned
    for extra, needle in (({"logits_processors": ["nope"]}, "'nope' is not loaded here; loaded: ['ban_tokens']"),
                          ({"logits_processors": {"ban_tokens": {"token_ids": "x"}}}, "token_ids must be")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="A", max_tokens=2, extra_body=extra)
        assert needle in str(e.value) and e.value.body["param"] == "logits_processors"


def test_gateway_hook_rejects_audits_and_cannot_crash_the_server(gateway):
    import httpx
    import openai

    gw, log = gateway
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0)
    model = gw.gateway.backend.model_name
    with pytest.raises(openai.PermissionDeniedError) as e:
        client.completions.create(model=model, prompt="A", max_tokens=2, user="blocked")
    assert e.value.body["code"] == "user_blocked"
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       user="hook-bug")
    assert e.value.body["code"] == "hook_error"
    ok = client.completions.create(model=model, prompt="A", max_tokens=2, user="alice")  # still serving
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'kvrelay:gateway_hook_errors_total{hook="audit"} 1.0' in metrics
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {"event": "request", "path": "/v1/completions", "user": "alice", "model": model} in records
    assert {"event": "response", "path": "/v1/completions", "status": 200, "id": ok.id} in records


def test_routing_policy_chosen_by_flag(installed):
    import argparse

    from kvrelay.gateway import cluster

    parser = argparse.ArgumentParser()
    cluster.add_arguments(parser)
    args = parser.parse_args(["--decode", "10.0.0.1:1,10.0.0.2:1", "--prefill", "10.0.0.3:1,10.0.0.4:1",
                              "--routing-policy", "round_robin"])
    backend = cluster.build_backend(args, args.prefill, args.decode)
    for pool in (backend.prefill, backend.decode):
        pool.set_members([a for a in (args.prefill if pool.role == "prefill" else args.decode).split(",")])
        for address in pool.workers:
            pool.report(address, num_waiting=0, num_running=0, kv_blocks_free=10, kv_blocks_total=10)
    picks = [backend.decode.pick_decode([1, 2]).address for _ in range(4)]
    assert picks == ["10.0.0.1:1", "10.0.0.2:1"] * 2  # turns, not affinity or load
    assert backend.prefill.pick_prefill([1, 2]).address == "10.0.0.3:1"
    args.routing_policy = "no-such-policy"
    with pytest.raises(ValueError, match=r"'no-such-policy' is not loaded; available: \['default', 'round_robin'\]"):
        cluster.build_backend(args, args.prefill, args.decode)


async def test_kv_transport_plugin_carries_a_handoff(installed):
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.kvtransfer.worker_base import WorkerOptions
    from kvrelay_example_plugins.transport import CountingTransport
    from pd_helpers import start_pair, stop_pair

    pair = await start_pair(decode_options=WorkerOptions(kv_transport="counting"))
    try:
        assert isinstance(pair.decode.transport, CountingTransport)
        prompt = list(range(5, 60))
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = [o async for o in pair.client.generate(prompt, params, "r1", prefill_addr=pair.prefill_addr)]
        assert sum(len(o.new_token_ids) for o in outs) == 8
        assert pair.decode.transport.pulls == 1 and pair.decode.transport.bytes > 0
    finally:
        await stop_pair(pair)
