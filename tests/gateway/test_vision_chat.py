"""Images in chat through `kvrelay serve` (engine-core process) and the official openai client: a
tiny LLaVA answers exactly as transformers does for the same rendered prompt and pixels, from data
URLs and from http URLs; each kind of bad image is a 400 naming its content part."""

from __future__ import annotations

import base64
import http.server
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from helpers import serve
from vision_models import hf_greedy, hf_inputs, image, png_bytes, save_tiny_llava

MAX_NEW = 10
RENDERED = "user: Once upon a time <image> there was <image> a\nassistant:"  # the fixture's template


class _Images(http.server.BaseHTTPRequestHandler):
    files: ClassVar[dict[str, bytes]] = {}

    def do_GET(self):
        if self.path == "/slow.png":
            time.sleep(6)
        body = self.files.get(self.path)
        try:
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")
        except (BrokenPipeError, ConnectionResetError):  # the slow image's fetch gave up first
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    _Images.files = {"/one.png": png_bytes(image(1)), "/slow.png": png_bytes(image(1))}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return save_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny-llava")


@pytest.fixture(scope="module")
def server(llava, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    with serve(log, "--model", str(llava), "--limit-mm-per-prompt", '{"image": 2}', "--max-image-bytes", "8000",
               "--media-fetch-timeout", "2", "--allowed-media-domains", "127.0.0.1") as url:
        yield url


def data_url(picture) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(picture)).decode()


def story(first: str, second: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "Once upon a time "}, {"type": "image_url", "image_url": {"url": first}},
        {"type": "text", "text": " there was "}, {"type": "image_url", "image_url": {"url": second}},
        {"type": "text", "text": " a"}]}]


def ask(url: str, messages: list[dict], **kw):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                          extra_body={"ignore_eos": True}, **kw)


def new_text(path: Path, ids: list[int], out: list[int]) -> str:
    """The new tokens' text as decoded after the prompt (with its leading space), as the server streams it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return tok.decode(ids + out, skip_special_tokens=True)[len(tok.decode(ids, skip_special_tokens=True)):]


def reference(llava: Path, pictures: list) -> tuple[str, int]:
    ids, pixels = hf_inputs(llava, RENDERED, pictures)
    return new_text(llava, ids, hf_greedy(llava, ids, pixels, MAX_NEW)), len(ids)


def test_chat_with_images_answers_as_transformers(server, llava):
    text, prompt_tokens = reference(llava, [image(1), image(2)])
    other, _ = reference(llava, [image(3), image(2)])
    assert text != other  # the images steer the answer
    r = ask(server, story(data_url(image(1)), data_url(image(2))))
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == prompt_tokens  # each image counts its 16 placeholder tokens
    counted = httpx.post(server + "/tokenize", json={"model": "tiny-llava", "messages": story("a", "b")}).json()
    assert counted["count"] == prompt_tokens  # /tokenize counts the same, without fetching the images
    assert ask(server, story(data_url(image(3)), data_url(image(2)))).choices[0].message.content == other
    chunks = ask(server, story(data_url(image(1)), data_url(image(2))), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_http_image_urls(server, llava, image_server):
    text, _ = reference(llava, [image(1), image(2)])
    base = f"http://127.0.0.1:{image_server}"
    assert ask(server, story(base + "/one.png", data_url(image(2)))).choices[0].message.content == text
    field = "messages[0].content[1].image_url.url"
    for url, message in [(base + "/missing.png", "answered HTTP 404"),
                         (f"http://localhost:{image_server}/one.png", "not among the allowed media domains"),
                         (base + "/slow.png", "took over 2.0 s")]:
        with pytest.raises(openai.BadRequestError) as e:
            ask(server, story(url, data_url(image(2))))
        assert e.value.body["param"] == field and message in e.value.body["message"], e.value.body


@pytest.mark.parametrize("messages,param,message", [
    (story("data:image/png;base64,@@@", data_url(image(2))), "messages[0].content[1].image_url.url", "does not decode"),
    (story("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), data_url(image(2))),
     "messages[0].content[1].image_url.url", "not an image"),
    (story("ftp://127.0.0.1/a.png", data_url(image(2))), "messages[0].content[1].image_url.url", "data: or http(s)"),
    (story(data_url(image(1, (200, 200))), data_url(image(2))), "messages[0].content[1].image_url.url",
     "over 8000 bytes"),
    (story(data_url(image(1)), data_url(image(2))) + [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image(3))}}]}], "messages", "more than the 2"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": data_url(image(1))}}]},
      {"role": "user", "content": "hi"}], "messages[0].content[0]", "go in user messages"),
])
def test_bad_images_are_400_naming_the_part(server, messages, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        ask(server, messages)
    assert e.value.body["param"] == param and message in e.value.body["message"], e.value.body
    assert ask(server, [{"role": "user", "content": "Once upon a time"}]).choices[0].message.content  # still serving


def test_responses_api_input_image(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(model="tiny-llava", messages=story(data_url(image(1)), data_url(image(2))),
                                          max_tokens=MAX_NEW, temperature=0)
    content = [{"type": "input_text", "text": "Once upon a time "},
               {"type": "input_image", "image_url": data_url(image(1))},
               {"type": "input_text", "text": " there was "},
               {"type": "input_image", "image_url": data_url(image(2))},
               {"type": "input_text", "text": " a"}]
    r = client.responses.create(model="tiny-llava", input=[{"role": "user", "content": content}],
                                max_output_tokens=MAX_NEW, temperature=0)
    assert r.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("family", ["qwen2-vl", "mistral3", "llava-next"])
def test_size_dependent_images_through_chat(tmp_path, family):
    """Images whose feature count follows their size (Qwen2-VL: a run per image; Mistral 3: rows ended
    by [IMG_BREAK] and [IMG_END]; LLaVA-NeXT: tiles), through an in-process server, answered as
    transformers does."""
    from gateway_helpers import InProcessGateway
    from vision_models import (
        hf_generate,
        hf_next_inputs,
        mistral3_inputs,
        qwen_inputs,
        save_tiny_llava_next,
        save_tiny_mistral3,
        save_tiny_qwen_vl,
    )

    if family == "qwen2-vl":
        path = save_tiny_qwen_vl(tmp_path / "tiny-vl", "2")
        marker, inputs = "<|vision_start|><|image_pad|><|vision_end|>", qwen_inputs
    elif family == "llava-next":
        path = save_tiny_llava_next(tmp_path / "tiny-vl")
        marker, inputs = "<image>", hf_next_inputs
    else:
        path = save_tiny_mistral3(tmp_path / "tiny-vl")
        marker, inputs = "[IMG]", mistral3_inputs
    pictures = [image(1, (60, 90)), image(2, (100, 50))]
    enc = inputs(path, f"user: Once upon a time {marker} there was {marker} a\nassistant:", pictures)
    ids = enc["input_ids"][0].tolist()
    want = new_text(path, ids, hf_generate(path, enc, MAX_NEW))
    gw = InProcessGateway(engine_kwargs={"model": str(path), "max_num_batched_tokens": 16})
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="tiny-vl", messages=story(*map(data_url, pictures)),
                                           max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == len(ids)  # each image's placeholders (and row ends) for its size
        counted = httpx.post(gw.url + "/tokenize", json={"model": "tiny-vl", "messages": story("a", "b")})
        assert counted.status_code == 400 and "as their size asks" in counted.json()["error"]["message"]
    finally:
        gw.stop()


def test_a_vision_model_takes_bodies_with_photos(server):
    """Without --max-body-bytes a vision-language server takes bodies of 32 MiB (a text model 2 MiB): a
    3 MB photo reaches the image checks (its own limit here is 8000 bytes) instead of a 413."""
    big = data_url(image(5, (1000, 1000)))
    assert 2 * 1024 * 1024 < len(big) < 32 * 1024 * 1024
    with pytest.raises(openai.BadRequestError) as e:
        ask(server, story(big, data_url(image(2))))
    assert "over 8000 bytes" in e.value.body["message"]
