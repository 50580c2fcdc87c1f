"""Image chat through the server: OpenAI `image_url` content parts (data URLs; local files only behind a flag),
limits and broken images as 400s naming the field, /tokenize counting image positions, the prefix cache keyed by
the image. The `tiny-vl` preset (random weights) with its preset tokenizer."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image
from live_server import LiveServer

from openflash.chat import chat_format
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.runtime.open import open_model
from openflash.serve.app import ServerConfig, build_app
from openflash.serve.images import ImagePolicy
from openflash.vision.preprocess import ImageLimits, prepare_image
from openflash.vision.prompt import PromptImage

NAME = "tiny-vl"
pytestmark = pytest.mark.usefixtures("one_thread")


def _png(h: int, w: int, seed: int = 0, mode: str = "RGB") -> bytes:
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _message(url: str, text: str = "What is in this image?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("images")
    (folder / "cat.png").write_bytes(_png(60, 80, seed=5))
    rt = open_model("tiny-vl")
    model, tok = rt.model, rt.tokenizer
    engine = LLMEngine(rt, EngineConfig(max_batch=4, max_context=512, prefill_chunk=32))
    fmt = chat_format(tok, model.cfg.bos_token_id, model.cfg.eos_token_id)
    policy = ImagePolicy(ImageLimits(max_bytes=200_000, max_pixels=2_000_000), max_images=2, local_dir=folder)
    app = build_app(engine, tok, ServerConfig(NAME, fmt, drain_timeout=2.0, images=policy))
    with LiveServer(app) as server:
        yield server, engine, folder


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_image_chat_through_the_openai_client(vl_server):
    server, engine, _ = vl_server
    client = server.client()
    a = client.chat.completions.create(model=NAME, messages=_message(_url(_png(60, 80, 1))), max_tokens=6,
                                       temperature=0)
    b = client.chat.completions.create(model=NAME, messages=_message(_url(_png(60, 80, 2))), max_tokens=6,
                                       temperature=0)
    again = client.chat.completions.create(model=NAME, messages=_message(_url(_png(60, 80, 1))), max_tokens=6,
                                           temperature=0)
    assert a.choices[0].message.content and a.choices[0].finish_reason == "length"
    assert a.choices[0].message.content != b.choices[0].message.content  # the image reaches the model
    assert again.choices[0].message.content == a.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # same image: its blocks are reused
    assert b.usage.prompt_tokens_details.cached_tokens < a.usage.prompt_tokens - 14  # never past another image

    count = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": _message(_url(_png(60, 80, 1)))})
    body = count.json()
    assert count.status_code == 200 and body["count"] == a.usage.prompt_tokens
    assert body["image_tokens"] == 17  # 80x60 px -> 129x96 (min_pixels) -> 140x98 -> 7x10 patches -> 3x4 cells


def test_streamed_image_chat_equals_plain_generation(vl_server):
    server, engine, _ = vl_server
    rt, model = engine.runtime, engine.model
    png = _png(40, 120, 3)
    messages = _message(_url(png), text="Caption:")
    stream = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0,
                                                     stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    ids = httpx.post(server.url + "/tokenize", json={"model": NAME, "messages": messages}).json()["tokens"]
    span = PromptImage(ids.index(model.cfg.image_token_id), prepare_image(png, model.cfg.vision))
    want = generate(rt, ids, SamplingParams(max_tokens=5, temperature=0), images=[span])
    assert text == want.text


@pytest.mark.parametrize("url,status,match", [
    ("data:image/png;base64,!!!notbase64", 400, "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not an image").decode(), 400, "not a readable image"),
    ("data:image/png;base64," + base64.b64encode(_png(30, 30)[:60]).decode(), 400, "damaged or truncated"),
    ("data:image/png," + "abc", 400, "must be base64"),
    ("https://example.com/cat.png", 400, "does not fetch images from the network"),
    ("data:image/png;base64," + base64.b64encode(_png(300, 400, 0)).decode(), 400, "over the limit of 200000 bytes"),
    ("/etc/hostname", 400, "outside the allowed image folder"),
    ("gopher://x/y.png", 400, "unsupported image URL scheme"),
])
def test_broken_or_refused_images_get_400_naming_the_part(vl_server, url, status, match):
    server, engine, _ = vl_server
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": _message(url),
                                                              "max_tokens": 2}, timeout=60)
    assert r.status_code == status, r.text
    err = _error(r)
    assert match in err["message"] and err["param"] == "messages.0.content.1.image_url.url"


def test_pixel_bombs_and_too_many_images_are_refused(vl_server):
    server, engine, _ = vl_server
    out = io.BytesIO()
    Image.new("L", (3000, 3000)).save(out, format="PNG")  # 9 Mpx of zeros: a few KB
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": NAME, "messages": _message(_url(out.getvalue())), "max_tokens": 2})
    assert r.status_code == 400 and "9000000 pixels, over the limit of 2000000" in _error(r)["message"]
    parts = [{"type": "image_url", "image_url": {"url": _url(_png(20, 20, k))}} for k in range(3)]
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    assert r.status_code == 400 and "over the limit of 2 per request" in _error(r)["message"]
    assert _error(r)["param"] == "messages.0.content.2.image_url.url"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _url(_png(20, 20))}}]}]})
    assert r.status_code == 400 and "only user messages carry images" in _error(r)["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_local_image_files_only_under_the_allowed_folder(vl_server):
    server, engine, folder = vl_server
    for url in (str(folder / "cat.png"), (folder / "cat.png").as_uri()):
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": NAME, "messages": _message(url), "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": NAME, "messages": _message(str(folder / "missing.png")), "max_tokens": 2})
    assert r.status_code == 400 and "no such image file" in _error(r)["message"]


def test_a_text_model_refuses_images_and_local_files_are_off_by_default():
    rt = open_model("tiny")
    model, tok = rt.model, rt.tokenizer
    engine = LLMEngine(rt, EngineConfig(max_batch=1, max_context=256))
    fmt = chat_format(tok, model.cfg.bos_token_id, model.cfg.eos_token_id)
    with LiveServer(build_app(engine, tok, ServerConfig("tiny", fmt, drain_timeout=2.0))) as server:
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": "tiny", "messages": _message(_url(_png(20, 20))), "max_tokens": 2})
        assert r.status_code == 400 and "no vision tower" in _error(r)["message"]
    vl = open_model("tiny-vl")
    engine = LLMEngine(vl, EngineConfig(max_batch=1, max_context=256))
    with LiveServer(build_app(engine, vl.tokenizer, ServerConfig("tiny-vl", fmt, drain_timeout=2.0))) as server:
        r = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": "tiny-vl", "messages": _message("/tmp/cat.png"), "max_tokens": 2})
        assert r.status_code == 400 and "local image paths are off" in _error(r)["message"]
