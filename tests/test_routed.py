"""The MoE's routed-sum paths (model/routed.py): each computes what `grouped` does on the same inputs, with the
same quantization points, up to fp32 summation order; `choose` picks one from the call's facts."""

from __future__ import annotations

import functools

import pytest
import torch

from openflash import formats, kernels
from openflash.config import load_config
from openflash.kernels import native, triton_products
from openflash.model import routed
from openflash.model.moe import MoE, batched_swiglu
from openflash.model.numerics import FP32, PLAIN, TRAIN


def _moe(storage: str) -> MoE:
    """An MoE layer of the tiny preset with unit-scale random weights, quantized as stored when asked."""
    torch.manual_seed(0)
    cfg = load_config("tiny")
    if storage == "quantized":
        cfg = cfg.replace(weight_dtype="fp8", expert_dtype="fp4")
    moe = MoE(cfg, 0)
    with torch.no_grad():
        for expert in list(moe.experts) + [moe.shared_experts]:
            for lin in (expert.w1, expert.w2, expert.w3):
                w = torch.randn(lin.out_features, lin.in_features) * lin.in_features ** -0.5
                if lin.storage == "fp4":
                    packed, scale = formats.quantize_mxfp4(w)
                    lin.weight.copy_(packed.view(torch.int8))
                    lin.scale.copy_(scale.view(torch.float8_e8m0fnu))
                elif lin.storage == "fp8":
                    q, scale = formats.quantize_fp8_blocks(w)
                    lin.weight.copy_(q.view(torch.float8_e4m3fn))
                    lin.scale.copy_(scale.view(torch.float8_e8m0fnu))
                else:
                    lin.weight.copy_(w)
    return moe


def _paths(moe: MoE, x, weights, ids, counts, shared) -> dict[str, torch.Tensor]:
    first = moe.experts[0]
    swiglu = functools.partial(batched_swiglu, limit=first.limit, act_quant=first.w1.quantized and
                               moe.numerics.act_quant, n=moe.numerics)
    every = {e: moe.experts[e] for e in range(moe.n_experts)}
    stack = lambda chosen: tuple(torch.stack([getattr(moe.experts[e], name).dequantized_weight() for e in chosen])  # noqa: E731
                                 for name in ("w1", "w3", "w2"))
    in_model = functools.partial(moe._native_experts, lambda chosen: {e: every[e] for e in chosen})
    every_expert = functools.partial(moe._native_experts, None)  # the decode graph's call: by expert id, slot order
    paths = {"native": routed.native(x, weights, ids, in_model, lambda y: y, shared),
             "native static": routed.native(x, weights, ids, every_expert, lambda y: y, shared, static=True)} \
        if first.w1.storage == "fp4" and native.status().available else {}
    return paths | {
        "batched": routed.batched(x, weights, ids, counts, stack, swiglu, shared),
        "gathered": routed.gathered(x, weights, ids, stack(range(moe.n_experts)), swiglu, shared),
        "sorted": routed.sorted_pairs(x, weights, ids, counts, moe.experts, shared),
        "offloaded": routed.offloaded(x, weights, ids, counts, lambda chosen: {e: every[e] for e in chosen},
                                      lambda y: y, shared),
    }


def _routed(storage: str, numerics, tokens: int):
    """An MoE layer under `numerics`, `tokens` inputs routed by its gate: (moe, x, weights, ids, counts, shared
    experts' output, `grouped`'s sum: what every path must give)."""
    moe = _moe(storage)
    for module in moe.modules():
        if hasattr(module, "numerics"):
            module.numerics = numerics
    x = torch.randn(tokens, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        weights, ids = moe.gate(x, None)
        counts = torch.bincount(ids.flatten(), minlength=moe.n_experts)
        shared = moe.shared_experts(x).float()
        want = routed.grouped(x, weights, ids, {e: moe.experts[e] for e in counts.nonzero().flatten().tolist()},
                              shared)
    return moe, x, weights, ids, counts, shared, want


@pytest.mark.parametrize("storage", ["float", "quantized"])
@pytest.mark.parametrize("numerics", [FP32, PLAIN], ids=["fp32", "plain"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_every_path_computes_the_grouped_sum(storage, numerics, tokens):
    moe, x, weights, ids, counts, shared, want = _routed(storage, numerics, tokens)
    with torch.no_grad():
        got = _paths(moe, x, weights, ids, counts, shared)
    untested = {"native"} if storage == "float" or not native.status().available else set()  # FP4 experts only
    assert {path.split()[0] for path in got} | {"grouped"} | untested == set(routed.ROUTED_PATHS)
    for path, y in got.items():
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{path}: {m}")


@pytest.mark.skipif(not triton_products.available(), reason="Triton is not installed")
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_the_layer_s_triton_experts_call_computes_the_grouped_sum(tokens, monkeypatch):
    """On CUDA the MoE's experts call goes to kernels/triton_experts.py (Triton's interpreter here, on the CPU):
    through the layer's kept table of its experts' addresses, by global expert id, in the eager step and in the
    decode graph's static call, one program per pair or (40 tokens: past PER_PAIR_CALLS pairs) tiles of one
    expert's pairs; the table is rebuilt when the experts move."""
    monkeypatch.setattr(kernels, "experts_kernel", lambda device, stored: "triton" if stored == "fp4" else None)
    tiled, tiled_call = [], kernels.triton_experts.tiled_call

    def counted(*args):
        tiled.append(args[2].numel())
        return tiled_call(*args)

    monkeypatch.setattr(kernels.triton_experts, "tiled_call", counted)
    moe, x, weights, ids, counts, shared, want = _routed("quantized", FP32, tokens)
    with torch.no_grad():
        in_model = functools.partial(moe._native_experts, lambda chosen: {e: moe.experts[e] for e in chosen})
        every_expert = functools.partial(moe._native_experts, None)
        for y in (routed.native(x, weights, ids, in_model, lambda y: y, shared),
                  routed.native(x, weights, ids, every_expert, lambda y: y, shared, static=True)):
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
        assert bool(tiled) == (ids.numel() > kernels.triton_experts.PER_PAIR_CALLS)
        table = moe.expert_tables()
        assert moe.expert_tables() is table
        moe._apply(lambda t: t.clone())  # what .to(device) does: every parameter and buffer replaced
        assert moe.expert_tables() is not table


def test_choose_takes_the_calls_facts():
    step = dict(static=False, offloaded=False, pairs=8, fp32_experts=True)
    assert routed.choose(FP32, **step) == "batched"
    assert routed.choose(FP32, **{**step, "pairs": routed.BATCHED_PAIRS + 1}) == "grouped"  # a prefill
    assert routed.choose(FP32, **{**step, "fp32_experts": False}) == "grouped"  # "stored" weights
    assert routed.choose(FP32, **{**step, "static": True}) == "gathered"
    assert routed.choose(FP32, **{**step, "offloaded": True}) == "offloaded"
    assert routed.choose(TRAIN, **step) == "sorted"
    stored = {**step, "fp32_experts": False, "native": True}  # FP4 experts kept as stored, kernels here
    assert routed.choose(FP32, **stored) == "native"
    assert routed.choose(FP32, **{**stored, "pairs": routed.NATIVE_PAIRS + 1}) == "grouped"
    assert routed.choose(FP32, **{**stored, "offloaded": True}) == "native"  # from an ExpertSource too
    assert routed.choose(FP32, **{**stored, "offloaded": True, "pairs": routed.NATIVE_PAIRS + 1}) == "offloaded"
    assert routed.choose(FP32, **{**stored, "static": True, "pairs": 96}) == "native"  # the decode graph: any pairs
    assert routed.choose(FP32, **{**stored, "pairs": 96, "any_pairs": True}) == "native"  # CUDA tiles a prefill
