"""LoRA adapters over weights kept as stored (model/lora.py): fresh adapters change nothing, gradients through an
FP8 or FP4 base equal autograd on its dequantized weight (the activation QDQ straight-through), and no fp32 copy of
the base appears."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from openflash import formats
from openflash.checkpoint import load_checkpoint
from openflash.model.adapters import add_lora
from openflash.model.layers import Linear
from openflash.model.lora import LoRA
from openflash.model.moe import MoE
from openflash.model.numerics import FINETUNE, FP32
from openflash.runtime.runtime import Runtime

GOLDEN_A2 = Path(__file__).parent / "goldens" / "A2"  # FP8 dense weights, FP4 experts


def _stored(storage: str, out: int, inp: int) -> Linear:
    torch.manual_seed(0)
    lin = Linear(inp, out, storage)
    w = torch.randn(out, inp) * inp ** -0.5
    q, s = formats.quantize_fp8_blocks(w) if storage == "fp8" else formats.quantize_mxfp4(w)
    lin.weight.copy_(q.view(lin.weight.dtype))
    lin.scale.copy_(s.view(torch.float8_e8m0fnu))
    lin.keep_dequantized, lin.numerics = False, FP32
    return lin


@pytest.mark.parametrize("storage", ["fp8", "fp4"])
@pytest.mark.parametrize("rows", [3, 40])  # through the kernels, and through dequantized tiles
def test_gradients_through_a_stored_base_equal_autograd_on_its_dequantized_weight(storage, rows):
    lin = _stored(storage, 96, 128)
    lin.adapter = LoRA(128, 96, rank=4, alpha=8.0)
    with torch.no_grad():
        lin.adapter.lora_B.normal_()  # a non-zero update, so every gradient is exercised
    x = torch.randn(rows, 128, requires_grad=True)
    weights = torch.randn(rows, 96)
    (lin(x) * weights).sum().backward()
    w = lin.dequantized_rows(0, 96)
    x2 = x.detach().clone().requires_grad_()
    a, b = (lin.adapter.lora_A.detach().clone().requires_grad_(), lin.adapter.lora_B.detach().clone().requires_grad_())
    xq = formats.ste(x2, formats.act_quant_qdq)
    want = xq @ w.t() + (x2 @ a.t() @ b.t()) * 2.0
    (want * weights).sum().backward()
    for got, ref in ((x.grad, x2.grad), (lin.adapter.lora_A.grad, a.grad), (lin.adapter.lora_B.grad, b.grad)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert lin.dequantized_bytes == 0  # no fp32 copy of the base was kept


def test_fresh_adapters_leave_the_logits_bit_identical_and_train_alone():
    model, report = load_checkpoint(GOLDEN_A2, weights="stored")
    rt = Runtime.of(model, report.tokenizer, frontend=report.engram_frontend)
    ids = torch.randint(3, model.cfg.vocab_size - 8, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = rt.forward(ids).logits
    adapted = add_lora(model, rank=4)
    assert any(".attn.wq_a" in n for n in adapted) and any(".ffn.experts." in n for n in adapted)
    assert not any("indexer" in n for n in adapted)
    with torch.no_grad():
        assert torch.equal(rt.forward(ids).logits, before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".adapter.lora_" in n for n in trainable)
    out = rt.forward(ids[:, :-1], ids[:, 1:])
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if n.endswith("lora_B")}
    assert all(g is not None for n, g in grads.items() if ".attn." in n)  # every attention adapter learns
    assert any(g is not None for n, g in grads.items() if ".experts." in n)  # the routed experts' (those picked)


def test_bad_adapter_arguments_are_named():
    with pytest.raises(ValueError, match="LoRA rank must be >= 1, got 0"):
        LoRA(8, 8, rank=0, alpha=1.0)
    model, _ = load_checkpoint(GOLDEN_A2, weights="stored")
    with pytest.raises(ValueError, match=r"no linear matches the LoRA targets \['nothing'\]"):
        add_lora(model, rank=2, targets=("nothing",))


def test_activation_checkpointing_gives_the_same_gradients_and_expert_loads():
    """`--checkpoint-activations`: each block reruns in the backward; the adapters' gradients and the counted
    expert loads are those of a plain backward."""
    model, report = load_checkpoint(GOLDEN_A2, weights="stored")
    rt = Runtime.of(model, report.tokenizer, frontend=report.engram_frontend)
    add_lora(model, rank=4)
    model.set_numerics(FINETUNE).train()
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, LoRA):
            m.lora_B.data.normal_(std=0.1)
    ids = torch.randint(3, model.cfg.vocab_size - 8, (2, 24), generator=torch.Generator().manual_seed(1))
    results = []
    for recompute in (False, True):
        model.checkpoint_blocks = recompute
        model.zero_grad(set_to_none=True)
        for m in model.modules():
            if isinstance(m, MoE):
                m.expert_load.zero_()
        rt.forward(ids[:, :-1], ids[:, 1:]).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((grads, [m.expert_load.clone() for m in model.modules() if isinstance(m, MoE)]))
    (plain, plain_loads), (rerun, rerun_loads) = results
    assert plain.keys() == rerun.keys() and len(plain) > 10
    for name, g in plain.items():
        torch.testing.assert_close(rerun[name], g, rtol=1e-4, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(plain_loads, rerun_loads))
