"""Vision input: preprocessing edge cases, the model's image path, and images through the engine (chunked
prefill, prefix cache, CED bounded replay). Parity with the official code is golden B2 (test_parity.py)."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from openflash.checkpoint import build_model, load_checkpoint, save_checkpoint
from openflash.config import load_config
from openflash.config_parts import VisionConfig
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.engine.generate import generate
from openflash.engine.sampling import SamplingParams
from openflash.errors import ConfigError, RequestError
from openflash.model.vision import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START
from openflash.runtime.runtime import Runtime
from openflash.tokenizer import preset_tokenizer
from openflash.vision.preprocess import (ImageError, ImageLimits, decode_image, num_image_tokens, plan_grid,
                                         prepare_image, usable_aspect)
from openflash.vision.prompt import EncodedImages, assemble, key_ids, text_prompt

RELEASED = VisionConfig(32, 1024, 16, 2816, 14, 10000.0, 3, 1024, 295_936, None)
B2 = VisionConfig(2, 96, 3, 128, 14, 10000.0, 3, 16, 8000, None)


def _png(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def _noise(h: int, w: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# ---- size planning (spec §A.2) -----------------------------------------------------------------------------------

def test_plan_grid_reproduces_both_resize_paths_of_golden_b2():
    small = plan_grid(60, 80, B2)  # width 60, height 80: below min_pixels, upscaled then rounded up to 14s
    assert (small.height, small.width, small.n_vit_h, small.n_vit_w, small.n_llm_h, small.n_llm_w) == \
        (112, 84, 8, 6, 3, 2)
    assert small.num_tokens == 11
    wide = plan_grid(300, 60, B2)  # 2x8 grid = 20 tokens > 16: shrunk to 42x210 px
    assert (wide.height, wide.width, wide.n_llm_h, wide.n_llm_w, wide.num_tokens) == (42, 210, 1, 5, 8)


@pytest.mark.parametrize("width,height", [(20, 100_000), (100_000, 20), (4000, 3000), (1, 1), (544, 544),
                                          (3000, 17), (17, 3000), (1920, 1080)])
def test_plan_grid_always_fits_the_token_cap_at_released_size(width, height):
    g = plan_grid(width, height, RELEASED)
    assert g.num_tokens <= RELEASED.max_image_tokens
    assert g.height % 14 == 0 and g.width % 14 == 0 and g.n_vit_h * 14 == g.height
    assert (g.n_llm_h, g.n_llm_w) == (math.ceil(g.n_vit_h / 3), math.ceil(g.n_vit_w / 3))


def test_very_tall_and_very_wide_images_collapse_to_one_column_or_row():
    tall, wide = plan_grid(20, 100_000, RELEASED), plan_grid(100_000, 20, RELEASED)
    assert (tall.width, tall.height, tall.n_llm_w) == (42, 511 * 42, 1)
    assert (wide.height, wide.width, wide.n_llm_h) == (42, 1021 * 42, 1)
    assert num_image_tokens(1, 1021) == 1024


def test_tiny_image_is_upscaled_to_min_pixels():
    g = plan_grid(1, 1, RELEASED)
    assert g.width == g.height == 546 and g.num_tokens == 13 * 14 + 2  # 544 rounded up to 39 patches


# ---- decoding and patches -----------------------------------------------------------------------------------------

def _modes() -> dict[str, bytes]:
    rgb = _noise(40, 70)
    rgba = rgb.convert("RGBA")
    rgba.putalpha(0)  # fully transparent: alpha is dropped (not composited), as the reference's convert("RGB")
    return {"rgb_png": _png(rgb), "palette_png": _png(rgb.convert("P")), "rgba_png": _png(rgba),
            "grey_png": _png(rgb.convert("L")), "grey_alpha_png": _png(rgb.convert("LA")),
            "jpeg": _png(rgb, "JPEG"), "grey16_png": _png(Image.fromarray(
                np.random.default_rng(1).integers(0, 65535, (40, 70), dtype=np.uint16)))}


@pytest.mark.parametrize("mode", list(_modes()))
def test_every_png_mode_and_jpeg_becomes_normalised_bf16_patches(mode):
    data = _modes()[mode]
    img = prepare_image(data, B2)
    g = img.grid
    assert img.patches.dtype == torch.bfloat16 and img.patches.shape == (g.n_vit_h * g.n_vit_w, 3, 14, 14)
    assert float(img.patches.min()) >= -1.0 and float(img.patches.max()) <= 1.0
    assert img.types.tolist() == [IMAGE_START] + ([IMAGE] * g.n_llm_w + [IMAGE_NEW_LINE]) * g.n_llm_h + [IMAGE_END]


@pytest.mark.parametrize("h,w", [(2000, 12), (12, 2000), (1, 1), (3000, 4000)])
def test_tall_wide_tiny_and_huge_images_fit_the_cap(h, w):
    img = prepare_image(_png(Image.new("RGB", (w, h), (200, 30, 90))), B2)
    g = img.grid
    assert g.num_tokens <= B2.max_image_tokens and img.types.numel() == g.num_tokens
    assert img.patches.shape[0] == g.n_vit_h * g.n_vit_w
    if h > 100 * w:
        assert g.n_llm_w == 1  # a single column
    if w > 100 * h:
        assert g.n_llm_h == 1  # a single row


def test_alpha_is_dropped_and_patches_are_row_major_channel_major():
    pixels = np.zeros((28, 28, 4), dtype=np.uint8)
    pixels[:14, 14:, 0] = 255  # top-right patch pure red, fully transparent
    cfg = VisionConfig(1, 32, 1, 32, 14, 10000.0, 3, 64, 1, None)
    img = prepare_image(_png(Image.fromarray(pixels, "RGBA")), cfg)
    assert img.grid.n_vit_h == img.grid.n_vit_w == 2
    assert torch.all(img.patches[1, 0] == 1.0) and torch.all(img.patches[1, 1:] == -1.0)  # patch 1 = (row 0, col 1)
    assert torch.all(img.patches[0] == -1.0) and torch.all(img.patches[2:] == -1.0)


def test_padding_is_gray_and_centred():
    cfg = VisionConfig(1, 32, 1, 32, 14, 10000.0, 3, 64, 1, None)
    img = prepare_image(Image.new("RGB", (28, 14), (255, 255, 255)), cfg)  # already a multiple of 14: no pad
    assert torch.all(img.patches == 1.0)
    img = prepare_image(Image.new("RGB", (28, 10), (255, 255, 255)), cfg)  # 28x14 target: 2 gray rows top + bottom
    gray = (127 / 255 - 0.5) / 0.5
    column = img.patches[0, 0, :, 0].float()
    assert torch.allclose(column[:2], torch.tensor(gray), atol=1e-2) and torch.all(column[2:12] == 1.0)


def test_path_pil_and_bytes_give_the_same_patches(tmp_path):
    image = _noise(50, 33, seed=3)
    path = tmp_path / "x.png"
    image.save(path)
    a, b, c = prepare_image(path, B2), prepare_image(image, B2), prepare_image(path.read_bytes(), B2)
    assert torch.equal(a.patches, b.patches) and torch.equal(a.patches, c.patches) and a.digest == c.digest
    assert prepare_image(_noise(50, 33, seed=4), B2).digest != a.digest


def test_broken_images_are_refused_with_a_named_error():
    good = _png(_noise(30, 30))
    with pytest.raises(ImageError, match="not a readable image"):
        decode_image(b"definitely not an image", where="messages.0.content.1")
    with pytest.raises(ImageError, match="damaged or truncated"):
        decode_image(good[: len(good) // 2])
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"")
    with pytest.raises(ImageError, match="over the limit of 100"):
        decode_image(good, ImageLimits(max_bytes=100))
    bomb = _png(Image.new("L", (6000, 6000)))  # 36 Mpx of zeros compresses to a few KB
    assert len(bomb) < 100_000
    with pytest.raises(ImageError, match="36000000 pixels, over the limit of 1000000"):
        decode_image(bomb, ImageLimits(max_pixels=1_000_000))
    with pytest.raises(ImageError, match="cannot read"):
        prepare_image("/nonexistent/cat.png", B2)


def test_elongated_images_are_refused_from_their_header():
    """A 1 x 39,999,999 PNG is 155 KB and under the pixel limit, but the preprocessing would shrink it into a strip
    less than a pixel wide after decoding 40 Mpx: refused from the header, before any pixel is decoded."""
    strip = _png(Image.new("L", (1, 39_999_999)))
    assert len(strip) < 200_000
    with pytest.raises(ImageError, match=r"1x39999999, 39999999:1 tall; beyond 21462:1 .* less than one pixel"):
        prepare_image(strip, RELEASED)
    assert usable_aspect(RELEASED, wide=True) == 1021 * 42 and usable_aspect(B2, wide=False) == 7 * 42
    with pytest.raises(ImageError, match="600x1, 600:1 wide"):
        prepare_image(Image.new("RGB", (600, 1)), B2)  # one row of 13 cells: 546 pixels, the image 546/600 high
    with pytest.raises(ImageError, match="1x300, 300:1 tall"):
        prepare_image(Image.new("RGB", (1, 300)), B2)  # one column of 7 cells: 294 pixels
    for size in ((500, 1), (2, 500)):  # within the limits: used
        image = prepare_image(Image.new("RGB", size), B2)
        assert image.grid.n_vit_h >= 1 and image.grid.n_vit_w >= 1


def test_vision_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="vision_config.patch_size must be a positive integer"):
        VisionConfig.from_dict({**RELEASED.__dict__, "patch_size": 0})
    with pytest.raises(ConfigError, match="missing key"):
        VisionConfig.from_dict({"num_hidden_layers": 2})


# ---- the model and the engine --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vl():
    cfg = load_config("tiny-vl")
    torch.manual_seed(0)
    return Runtime.of(build_model(cfg, "fp32").eval(), preset_tokenizer(cfg))


def _prompt(vl, seed: int = 0, text: str = "Look: <image> and tell me what you see in it, please."):
    return text_prompt(vl.tokenizer, text, [_noise(70, 90, seed)], vl.cfg)


def test_an_image_changes_the_logits_and_its_delimiters_take_the_learned_vectors(vl):
    rt = vl
    model = rt.model
    ids, images = _prompt(vl)
    img = images[0].image
    rows = model.encode_image(img.patches, img.grid.n_vit_h, img.grid.n_vit_w, img.types)
    assert torch.equal(rows[0], model.image_start.detach()) and torch.equal(rows[-1], model.image_end.detach())
    assert torch.equal(rows[img.types == IMAGE_NEW_LINE][0], model.image_newline.detach())
    a = generate(rt, ids, SamplingParams(max_tokens=4, temperature=0), images=images)
    other_ids, other = _prompt(vl, seed=1)
    b = generate(rt, other_ids, SamplingParams(max_tokens=4, temperature=0), images=other)
    assert ids == other_ids and a.token_ids != b.token_ids  # same ids, different image, different output


@pytest.mark.parametrize("mode", ["exact", "bounded"])
def test_image_span_split_across_prefill_chunks_matches_one_chunk(vl, mode):
    rt = vl
    model = rt.model
    ids, images = _prompt(vl)
    span = images[0]
    outs = []
    for chunk in (len(ids), span.start + 3):  # one chunk; a cut through the span
        cache = rt.new_cache(1)
        encoded = EncodedImages(images, model)
        for i in range(0, len(ids), chunk):
            x = torch.tensor([ids[i:i + chunk]])
            rows = encoded.window(i, i + x.shape[1], model.device)
            logits = rt.step(x, cache, mode=mode, last_chunk=i + chunk >= len(ids), images=rows)
        outs.append(logits)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_prefix_cache_keys_differ_by_image_only():
    a = assemble([[5, 6, 7], _fake(digest="aa" * 16), [8]], image_token_id=99)
    b = assemble([[5, 6, 7], _fake(digest="bb" * 16), [8]], image_token_id=99)
    assert a[0] == b[0] and key_ids(*a) != key_ids(*b) and key_ids(*a)[:3] == [5, 6, 7]


def _fake(digest: str):
    from openflash.vision.preprocess import ImageGrid, PreparedImage, span_types
    grid = ImageGrid(14, 14, 1, 1, 1, 1)
    return PreparedImage(torch.zeros(1, 3, 14, 14, dtype=torch.bfloat16), grid, span_types(1, 1), digest)


@pytest.mark.parametrize("restore", ["snapshot", "replay"])
def test_engine_with_images_matches_plain_generation_and_prefix_cache_never_confuses_images(vl, restore):
    rt = vl
    model, tok = rt.model, rt.tokenizer
    params = SamplingParams(max_tokens=5, temperature=0)
    # A 112x112 image is a 14-token span, so the first 16-token block holds it and stays within the 16-token
    # window: a replay-restored prefix is then exact too.
    prompts = [text_prompt(tok, "<image> What is in this picture?", [_noise(112, 112, seed)],
                           model.cfg) for seed in (0, 1, 0)]
    assert prompts[0][1][0].end == 14 and 16 < len(prompts[0][0]) <= 32
    want = [generate(rt, ids, params, images=images, prefill_chunk=16).token_ids for ids, images in prompts]
    assert want[0] != want[1]
    engine = LLMEngine(rt, EngineConfig(max_batch=2, max_context=256, prefill_chunk=16, prefix_cache=True,
                                                prefix_restore=restore, prefix_block_tokens=16))
    seqs = [engine.generate([ids], params, images=[images])[0] for ids, images in prompts]  # one at a time
    assert [s.output_ids for s in seqs] == want
    assert [s.num_cached for s in seqs] == [0, 0, 16]  # the other image never hits; the same image does


def test_packed_prefill_carries_each_prompts_image_rows(vl):
    """Image prompts of one length (and a text prompt) prefilled in one call: each row gets its own spans."""
    rt = vl
    model, tok = rt.model, rt.tokenizer
    params = SamplingParams(max_tokens=4, temperature=0)
    prompts = [text_prompt(tok, "<image> What is in this picture?", [_noise(112, 112, seed)], model.cfg)
               for seed in (0, 1)]
    prompts.append((prompts[0][0][:2] + [7] * (len(prompts[0][0]) - 2), []))  # text only, same length
    want = [generate(rt, ids, params, images=images, prefill_chunk=16).token_ids
            for ids, images in prompts]
    engine = LLMEngine(rt, EngineConfig(max_batch=3, max_context=256, prefill_chunk=16, prefix_cache=False))
    seqs = engine.generate([ids for ids, _ in prompts], params, images=[images for _, images in prompts])
    assert [s.output_ids for s in seqs] == want
    assert engine.runner.prefill_calls == -(-len(prompts[0][0]) // 16)  # one call per chunk for all three


def test_prompts_of_different_lengths_with_images_share_padded_calls(vl):
    """Image prompts of different lengths (and a shorter text prompt) right-padded into shared calls: each row gets
    its own spans, the padding none; outputs equal plain generation, in fewer calls than without padding."""
    rt = vl
    model, tok = rt.model, rt.tokenizer
    params = SamplingParams(max_tokens=4, temperature=0)
    prompts = [text_prompt(tok, text, [_noise(112, 112, seed)], model.cfg)
               for seed, text in ((0, "<image> What is in this picture?"), (1, "Look at this: <image> What do you see in it, exactly?"))]
    prompts.append((prompts[0][0][:2] + [7] * 5, []))  # text only, 7 tokens
    assert len({len(ids) for ids, _ in prompts}) == 3
    want = [generate(rt, ids, params, images=images, prefill_chunk=64).token_ids for ids, images in prompts]
    calls = []
    for padding in (0.0, 0.75):
        engine = LLMEngine(rt, EngineConfig(max_batch=3, max_context=256, prefill_chunk=64, prefix_cache=False,
                                                    prefill_padding=padding))
        seqs = engine.generate([ids for ids, _ in prompts], params, images=[images for _, images in prompts])
        assert [s.output_ids for s in seqs] == want
        calls.append(engine.runner.prefill_calls)
    assert calls == [3, 1]  # one chunk each: a call per length, or one padded call


def test_engine_refuses_images_for_a_text_model_and_bad_spans(vl):
    rt = vl
    tok = rt.tokenizer
    ids, images = _prompt(vl)
    engine = LLMEngine(rt, EngineConfig(max_batch=1, max_context=256))
    with pytest.raises(RequestError, match="must all hold the image token id"):
        engine.add_request(ids[:-1] + [3] if images[0].end == len(ids) else
                           ids[:images[0].start] + [3] + ids[images[0].start + 1:], SamplingParams(), images=images)
    text_cfg = load_config("tiny")
    with pytest.raises(RequestError, match="no vision tower"):
        text_prompt(tok, "<image>", [_noise(20, 20)], text_cfg)


def test_vision_weights_round_trip_in_the_official_dtypes(vl, tmp_path):
    rt = vl
    model = rt.model
    folder = save_checkpoint(model, tmp_path / "ckpt", dtype="fp8")
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["vision.blocks.0.attn.wqkv.weight"] == "BF16" and dtypes["vision.norm.weight"] == "BF16"
    assert dtypes["aligner.w1.bias"] == "BF16" and dtypes["image_start"] == "BF16"
    loaded, _ = load_checkpoint(folder)
    torch.testing.assert_close(loaded.vision.blocks[1].mlp.w2.weight,
                               model.vision.blocks[1].mlp.w2.weight.to(torch.bfloat16).float())
