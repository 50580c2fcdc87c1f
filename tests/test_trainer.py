"""Training loop (openflash.train.trainer / optim): schedule, parameter groups, router balancing, exact resume,
indexer warm-up, checkpoints and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from openflash.cli import main as cli_main
from openflash.commands.train import train as train_command
from openflash.errors import OpenflashError
from openflash.files.manifest import MANIFEST_FILE, verify_manifest
from openflash.files.run_dir import STATE_FILE, checkpoint_dirs, latest_checkpoint
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.runtime.runtime import Runtime
from openflash.threads import ThreadTuner
from openflash.tokenizer import load_tokenizer
from openflash.train.optim import (OptimConfig, Schedule, TrainOptimizer, expert_loads, load_stats, newton_schulz,
                                   reset_expert_loads, update_router_bias)
from openflash.train.prepare import prepare_dataset
from openflash.train.tokenizer import train_bpe_tokenizer
from openflash.train.trainer import TrainConfig, Trainer, training_model_config

SMALL_RUN = dict(config="tiny", batch_size=4, seq_len=32, lr=3e-3, warmup=2, eval_batches=2, progress=False)


def make_corpus(folder: Path, files: int = 12) -> list[Path]:
    """A few small Python-like files with enough repetition for a BPE tokenizer to find merges."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        body = "".join(f"def function_{i}_{j}(value, other={j}):\n    result = value * {j} + other\n"
                       f"    if result > {i * j}:\n        return result - {i}\n    return str(result)\n\n"
                       for j in range(20))
        path = folder / f"module_{i:02d}.py"
        path.write_text(f'"""Module {i}."""\nimport os\n\n' + body)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trainer_data")
    files = make_corpus(root / "corpus")
    train_bpe_tokenizer(files, 512, root / "tokenizer.json")
    prepare_dataset([root / "corpus"], root / "tokenizer.json", root / "data", val_fraction=0.2, progress=False)
    return root / "data"


def _runtime(model, dataset: Path) -> Runtime:
    """The model's runtime, its Engram tables addressed through the dataset's tokenizer."""
    return Runtime.of(model, load_tokenizer(dataset / "tokenizer.json"))


def _fit(dataset: Path, out: Path, on_step=None, **overrides) -> tuple[Trainer, list[dict]]:
    records: list[dict] = []

    def hook(trainer: Trainer, record: dict) -> None:
        records.append(record)
        if on_step is not None:
            on_step(trainer, record)

    args = dict(SMALL_RUN, data=str(dataset), out=str(out))
    args.update(overrides)
    if args.get("init") is not None:  # a fine-tuning run's config is its --init's
        args.pop("config", None)
    trainer = Trainer(TrainConfig(**args), on_step=hook)
    trainer.fit()
    return trainer, records


# ---- schedule, groups, balancing ------------------------------------------------------------------------------

def test_schedule_warmup_cosine_and_indexer_stage() -> None:
    s = Schedule(warmup=4, total=24, indexer_warmup=0, min_ratio=0.1)
    assert [s.multiplier(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.multiplier(4) == pytest.approx(1.0)
    assert s.multiplier(14) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.multiplier(23) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 19 / 20)))
    assert s.multiplier(100) == pytest.approx(0.1)
    staged = Schedule(warmup=4, total=24, indexer_warmup=8)
    # Stage 1 ramps up and holds; the main stage then warms up again from its first step.
    assert [staged.multiplier(i) for i in range(8)] == [0.25, 0.5, 0.75, 1, 1, 1, 1, 1]
    assert [staged.multiplier(8 + i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert staged.multiplier(23) < 0.2


def test_parameter_groups(dataset: Path) -> None:
    cfg = training_model_config("tiny", dataset / "tokenizer.json")
    from openflash.model.transformer import Transformer
    model = Transformer(cfg)
    opt = TrainOptimizer(model, OptimConfig(lr=1e-3, weight_decay=0.1, engram_lr_mult=5.0))
    groups = {g["name"]: g for g in opt.adam.param_groups}
    assert sorted(opt.names["engram"]) == ["layers.1.engram.embed.weight", "layers.2.engram.embed.weight"]
    assert groups["engram"]["lr"] == pytest.approx(5e-3) and groups["engram"]["weight_decay"] == 0.0
    assert groups["decay"]["weight_decay"] == 0.1 and groups["no_decay"]["weight_decay"] == 0.0
    assert "layers.0.attn_norm.weight" in opt.names["no_decay"] and "head.weight" in opt.names["decay"]
    assert not any(n.endswith("gate.bias") for names in opt.names.values() for n in names)  # a buffer
    opt.set_lr_multiplier(0.5)
    assert groups["engram"]["lr"] == pytest.approx(2.5e-3) and opt.lr() == pytest.approx(5e-4)

    muon = TrainOptimizer(model, OptimConfig(lr=1e-3, optimizer="muon"))
    assert {"layers.0.attn.wq_a.weight", "layers.3.ffn.experts.5.w2.weight"} <= set(muon.names["muon"])
    assert "head.weight" in muon.names["decay"] and "embed.weight" in muon.names["decay"]
    assert muon.names["engram"] == opt.names["engram"]
    with pytest.raises(OpenflashError, match="optimizer must be"):
        TrainOptimizer(model, OptimConfig(optimizer="sgd"))


def test_newton_schulz_orthogonalises() -> None:
    g = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    o = newton_schulz(g, steps=5)
    s = torch.linalg.svdvals(o)
    assert o.shape == g.shape and s.min() > 0.5 and s.max() < 1.3  # singular values pushed towards 1


def test_router_bias_balancing(dataset: Path) -> None:
    from openflash.model.transformer import Transformer
    rt = _runtime(Transformer(training_model_config("tiny", dataset / "tokenizer.json")).train(), dataset)
    model = rt.model
    n_layers = len(model.layers)
    assert expert_loads(model).shape == (n_layers, 8) and expert_loads(model).sum() == 0
    x = torch.randint(3, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    rt.forward(x, x)
    loads = expert_loads(model)
    assert torch.equal(loads.sum(1), torch.full((n_layers,), 2 * 24 * 2.0))  # 2 experts per token
    update_router_bias(model, loads, rate=0.01)
    bias = model.layers[0].ffn.gate.bias
    expected = 0.01 * torch.sign(loads[0].mean() - loads[0])
    assert torch.equal(bias, expected)
    reset_expert_loads(model)
    assert expert_loads(model).sum() == 0
    stats = load_stats(torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]]))
    assert stats == {"load_max_mean": [1.0, 4.0], "load_max_mean_worst": 4.0}


# ---- fused training ops ---------------------------------------------------------------------------------------

def test_the_training_attention_in_chunks_equals_it_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """dense_sparse_attention with its query blocks in chunks recomputed in the backward (long prompts: memory
    bounded) against one chunk, in float64: the same outputs, picked probabilities and gradients (q, window keys,
    compressed entries, sink), and its gradients against finite differences."""
    from torch.autograd import gradcheck

    import openflash.model.sink_attention as sink_attention

    gen = torch.Generator().manual_seed(4)
    B, S, H, D, W, T, K = 2, 37, 2, 4, 4, 9, 3

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    q, kv, compressed, sink = rand(B, S, H, D), rand(B, S, D), rand(B, T, D), rand(H)
    picks = torch.randint(-1, T, (B, S, K), generator=gen)
    weight = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)

    def run(q, kv, compressed, sink):
        o, _ = sink_attention.dense_sparse_attention(q, kv, W, compressed, picks, sink, 0.4)
        return (o * weight).sum()  # (the probabilities are outputs without a gradient)

    def outputs_and_gradients():
        o, p = sink_attention.dense_sparse_attention(q, kv, W, compressed, picks, sink, 0.4)
        return o, p, torch.autograd.grad(run(q, kv, compressed, sink), (q, kv, compressed, sink))

    whole = outputs_and_gradients()
    monkeypatch.setattr(sink_attention, "CHUNK_SCORES", 2 * B * W * H * (2 * W + T + 1))  # 2 blocks a chunk
    chunked = outputs_and_gradients()
    for a, b in zip((whole[0], whole[1], *whole[2]), (chunked[0], chunked[1], *chunked[2])):
        torch.testing.assert_close(a, b)
    assert gradcheck(run, (q, kv, compressed, sink))


def test_fused_ops_have_exact_gradients() -> None:
    """The hand-written backward passes of the training path, against finite differences in float64."""
    from torch.autograd import gradcheck

    from openflash.model.layers import _RMSNormFunction
    from openflash.model.mhc import HcIn, HcOut, Sinkhorn, sinkhorn
    from openflash.model.moe import _SwiGLU
    from openflash.model.sink_attention import _DenseSinkAttention

    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_()

    R, pre, fn = rand(2, 3, 4, 8), rand(2, 3, 4), rand(24, 32)
    assert gradcheck(HcIn.apply, (R, pre, fn))
    assert gradcheck(HcOut.apply, (rand(2, 3, 8), R, rand(2, 3, 4), rand(2, 3, 4, 4)))
    logits = rand(2, 3, 4, 4)
    assert gradcheck(lambda t: Sinkhorn.apply(t, 4, 1e-6), (logits,))
    assert torch.allclose(Sinkhorn.apply(logits, 20, 1e-6), sinkhorn(logits, 20, 1e-6), atol=1e-12)
    mask = torch.rand(2, 5, 7, generator=gen) > 0.3
    assert gradcheck(lambda q, kv, sink: _DenseSinkAttention.apply(q, kv, mask, sink, 0.3)[0],
                     (rand(2, 5, 3, 4), rand(2, 7, 4), rand(3)))
    assert gradcheck(lambda x, w: _RMSNormFunction.apply(x, w, 1e-6), (rand(3, 5, 8), rand(8)))
    assert gradcheck(lambda g, u, w: _SwiGLU.apply(g, u, w, 5.0), (rand(6, 8, scale=6), rand(6, 8, scale=6), rand(6)))


def test_fused_training_forward_matches_unfused(dataset: Path) -> None:
    """Whole model, train policy with and without the fused ops: same loss and gradients up to rounding. No cache
    QDQ, all experts and all entries selected, so no discrete choice can flip on a rounding difference."""
    from openflash.model.numerics import TRAIN
    from openflash.model.transformer import Transformer

    cfg = training_model_config("tiny", dataset / "tokenizer.json").replace(num_experts_per_tok=8, index_topk=32,
                                                                             candidate_topk_blocks=8)
    torch.manual_seed(0)
    rt = _runtime(Transformer(cfg).train(), dataset)
    model = rt.model
    x = torch.randint(3, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    results = []
    for fused in (False, True):
        model.set_numerics(dataclasses.replace(TRAIN, cache_qdq=False, fused_train_ops=fused))
        model.zero_grad(set_to_none=True)
        out = rt.forward(x, x)
        (out.loss + 0.1 * out.indexer_loss).backward()
        results.append((out.loss.item(), out.indexer_loss.item(),
                        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, kl_a, grads_a), (loss_b, kl_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-6) and kl_a == pytest.approx(kl_b, rel=1e-4)
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_a.items():
        scale = g.abs().max().item() + 1e-12
        assert (g - grads_b[name]).abs().max().item() <= 1e-3 * scale, name


def test_top_entries_select_matches_sorting() -> None:
    """Many ties (-0.0 and +0.0 among them, which the sorts find equal), -inf entries, and a long row (ids past
    2^16): the selection's picks are the two sorts'."""
    from openflash.model.indexer import top_entries, top_entries_select

    gen = torch.Generator().manual_seed(0)
    for _ in range(100):
        T = int(torch.randint(1, 40, (1,), generator=gen))
        k = int(torch.randint(1, T + 1, (1,), generator=gen))
        scores = torch.randint(-3, 4, (2, 5, T), generator=gen).float()  # many ties
        scores = scores * (torch.randint(0, 2, scores.shape, generator=gen) * 2 - 1)  # zeros of both signs
        scores[torch.rand(2, 5, T, generator=gen) < 0.3] = float("-inf")
        n_visible = torch.randint(0, T + 1, (2, 5), generator=gen)
        assert torch.equal(top_entries(scores, k, n_visible), top_entries_select(scores, k, n_visible))
    scores = torch.randn(1, 2, 100_000, generator=gen).round(decimals=1)
    n_visible = torch.tensor([[100_000, 70_000]])
    assert torch.equal(top_entries(scores, 512, n_visible), top_entries_select(scores, 512, n_visible))


def test_thread_tuner_follows_step_times() -> None:
    tuner = ThreadTuner((2, 1), every=4)
    slow_two = {2: 5.0, 1: 1.0}  # another process holds a core: 2 threads spin and lose
    used = []
    for step in range(14):
        threads = tuner.threads_for(step)
        used.append(threads)
        tuner.record(threads, slow_two[threads])
    assert used[:3] == [2, 1, 2]  # warm-up step, then one probe step per candidate
    assert used[3:].count(2) <= 2  # afterwards 2 threads only on (backed-off) probe steps
    assert tuner.current == 1 and tuner.backoff[2] >= 2  # the loser is probed less often
    fast_two = {2: 1.0, 1: 1.8}
    for step in range(14, 40):
        threads = tuner.threads_for(step)
        tuner.record(threads, fast_two[threads])
    assert tuner.current == 2


# ---- the loop ---------------------------------------------------------------------------------------------------

def test_resume_reproduces_uninterrupted_run(dataset: Path, tmp_path: Path) -> None:
    full, full_records = _fit(dataset, tmp_path / "full", steps=6, eval_every=3, save_every=0)

    def interrupt_at_3(trainer: Trainer, record: dict) -> None:
        if record["step"] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does: finish the step, save, return

    first, first_records = _fit(dataset, tmp_path / "split", on_step=interrupt_at_3, steps=6, eval_every=3,
                                save_every=0)
    assert first.step == 3 and [p.name for p in checkpoint_dirs(tmp_path / "split")] == ["step_00000003"]
    second, second_records = _fit(dataset, tmp_path / "split", steps=6, eval_every=3, save_every=0, resume=True)
    assert second.step == 6
    full_losses = [r["loss_exact"] for r in full_records]
    split_losses = [r["loss_exact"] for r in first_records + second_records]
    assert split_losses == full_losses  # bitwise
    for (name, a), b in zip(full.model.state_dict().items(), second.model.state_dict().values()):
        assert torch.equal(a, b), name
    # metrics.jsonl of the resumed run holds each step once, and the validation points.
    lines = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in lines if "val_loss" in r] == [0, 3, 6]
    assert all(r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-4) for r in lines if "val_loss" in r)


def test_metrics_checkpoint_and_generation(dataset: Path, tmp_path: Path) -> None:
    trainer, records = _fit(dataset, tmp_path / "run", steps=3, eval_every=0, save_every=2)
    r = records[-1]
    for key in ("step", "loss", "lr", "tokens_per_s", "grad_norm", "load_max_mean", "load_max_mean_worst",
                "indexer_loss"):
        assert key in r, key
    assert len(r["load_max_mean"]) == len(trainer.model.layers) and all(v >= 1.0 for v in r["load_max_mean"])
    assert math.isfinite(r["indexer_loss"]) and records[0]["lr"] == pytest.approx(1.5e-3)
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt.name == "step_00000003" and len(checkpoint_dirs(tmp_path / "run")) == 1  # older one removed
    assert {p.name for p in ckpt.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json", STATE_FILE,
                                               MANIFEST_FILE}
    verify_manifest(ckpt)  # the trainer state is covered too
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp*"))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    vocab = load_tokenizer(dataset / "tokenizer.json").get_vocab_size(with_added_tokens=True)
    assert saved["text_config"]["vocab_size"] == vocab and "image_token_id" not in saved
    # The checkpoint is an ordinary model folder: the inference loader reads it and reproduces the weights.
    rt = open_model(str(ckpt), placement=Placement(weights="dequantized"))
    for name, t in trainer.model.state_dict().items():
        assert torch.equal(rt.model.state_dict()[name], t), name
    from openflash.engine.generate import generate
    from openflash.engine.sampling import SamplingParams
    out = generate(rt, "def function_1", SamplingParams(max_tokens=5))
    assert len(out.token_ids) == 5


def test_indexer_warmup_trains_only_the_indexer(dataset: Path, tmp_path: Path) -> None:
    snapshots = []

    def snap(trainer: Trainer, record: dict) -> None:
        snapshots.append({k: v.clone() for k, v in trainer.model.state_dict().items()})

    trainer, records = _fit(dataset, tmp_path / "iw", on_step=snap, steps=3, indexer_warmup=2, eval_every=0)
    assert [r.get("stage") for r in records] == ["indexer_warmup", "indexer_warmup", None]
    assert all(math.isfinite(r["indexer_loss"]) for r in records)
    before, after = snapshots[0], snapshots[1]
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".attn.indexer." in k for k in changed)
    assert any(k.endswith("indexer.wq_b.weight") for k in changed)
    final = snapshots[2]
    assert not torch.equal(after["layers.0.attn.wq_a.weight"], final["layers.0.attn.wq_a.weight"])
    assert not torch.equal(after["layers.0.ffn.gate.bias"], final["layers.0.ffn.gate.bias"])  # balancing runs


def test_muon_and_time_limit(dataset: Path, tmp_path: Path) -> None:
    trainer, records = _fit(dataset, tmp_path / "muon", steps=50, optimizer="muon", max_minutes=1e-4,
                            eval_every=0)
    assert trainer.step == 1 and math.isfinite(records[0]["loss"])  # the deadline passed during step 1
    assert latest_checkpoint(tmp_path / "muon").name == "step_00000001"


def test_a_time_budget_is_a_deadline_whatever_the_first_steps_cost(dataset: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The first steps slow (a busy machine: 0.5 s each on the trainer's clock), the rest fast (0.1 s): the run
    trains on to its deadline, planning again as the pace changes, rather than stopping at the count the slow steps
    fitted (make demo stopped after 3 of its 10 minutes). The clock is the test's, so the machine's speed does not
    matter."""
    import openflash.train.trainer as trainer_module

    clock = [0.0]

    def monotonic() -> float:
        clock[0] += 1e-6  # (a step's own timing sees time pass)
        return clock[0]

    monkeypatch.setattr(trainer_module, "time", SimpleNamespace(monotonic=monotonic))
    budget, slow = 6.0, 6
    trainer = Trainer(TrainConfig(**dict(SMALL_RUN, data=str(dataset), out=str(tmp_path / "budget"), steps=1_000_000,
                                         max_minutes=budget / 60, steps_from_budget=True, eval_every=0,
                                         save_every=0)))
    step = trainer.train_step

    def busy_then_quiet() -> dict:
        record = step()
        record["step_seconds"] = 0.5 if trainer.step <= slow else 0.1
        clock[0] += record["step_seconds"]
        return record

    trainer.train_step = busy_then_quiet
    result = trainer.fit()
    assert result.stopped_by in ("steps", "time")
    assert clock[0] > budget - 2.5, f"stopped at {clock[0]:.1f} s of {budget} s, step {trainer.step}"
    assert trainer.step >= slow + (budget - 2.5 - slow * 0.5) / 0.1


def test_run_folder_errors(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(OpenflashError, match="no checkpoint"):
        Trainer(TrainConfig(**SMALL_RUN, data=str(dataset), out=str(tmp_path / "new"), resume=True))
    _fit(dataset, tmp_path / "run", steps=1, eval_every=0)
    with pytest.raises(OpenflashError, match="already holds checkpoints"):
        Trainer(TrainConfig(**SMALL_RUN, data=str(dataset), out=str(tmp_path / "run")))
    with pytest.raises(OpenflashError, match="seq_len"):
        Trainer(TrainConfig(**dict(SMALL_RUN, seq_len=64), data=str(dataset), out=str(tmp_path / "run"), resume=True))
    with pytest.raises(OpenflashError, match="indexer-warmup"):
        TrainConfig(data="d", out="o", steps=5, indexer_warmup=5)
    with pytest.raises(OpenflashError, match="no prepared dataset"):
        Trainer(TrainConfig(**SMALL_RUN, data=str(tmp_path / "nothing"), out=str(tmp_path / "x")))


def test_compiled_training_matches_eager(dataset: Path, tmp_path: Path, monkeypatch) -> None:
    """`train --compile`: each block one graph (no break: the MoE runs between graphs), the same losses and
    gradient norms as the eager run, evaluation eager (no second set of graphs). The graphs run on "aot_eager"
    here (dynamo's capture and AOTAutograd's derived backward, eager kernels: seconds instead of minutes of C++
    codegen); benchmarks/train_speed.py --backends eager compiled checks inductor's kernels the same way."""
    from torch._dynamo.utils import counters

    from openflash.model import compiled_blocks

    monkeypatch.setattr(compiled_blocks, "BACKEND", "aot_eager")
    run = dict(steps=2, eval_every=1, save_every=0)
    _, eager = _fit(dataset, tmp_path / "eager", **run)
    counters.clear()
    trainer, compiled = _fit(dataset, tmp_path / "compiled", compile=True, **run)
    assert trainer.model.numerics.compiled
    assert counters["stats"]["unique_graphs"] == len(trainer.model.layers) and not counters["graph_break"]
    (eager1, eager2), (compiled1, compiled2) = eager, compiled
    assert compiled1["loss"] == pytest.approx(eager1["loss"], rel=1e-5)
    assert compiled1["grad_norm"] == pytest.approx(eager1["grad_norm"], rel=1e-4)
    # Adam's first update is about lr * sign(gradient): where a gradient entry is near 0, a last-bit difference
    # flips its step, so the second step agrees less closely.
    assert compiled2["loss"] == pytest.approx(eager2["loss"], rel=1e-3)
    with pytest.raises(OpenflashError, match="--compile builds its kernels for one thread count"):
        TrainConfig(data="d", out="o", compile=True, adaptive_threads=True)
    with pytest.raises(OpenflashError, match="--compile compiles the main model's training"):
        train_command(argparse.Namespace(dspark=True, vision_data=None, compile=True))
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(OpenflashError, match="--compile needs a C\\+\\+ compiler .*'no-such-c\\+\\+' is not on PATH"):
        Trainer(TrainConfig(**SMALL_RUN, data=str(dataset), out=str(tmp_path / "no_cxx"), compile=True))


def test_cli_train(dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "cli"
    def argv(steps: int, *extra: str) -> list[str]:
        return ["train", "--config", "tiny", "--data", str(dataset), "--out", str(out), "--steps", str(steps),
                "--batch-size", "2", "--seq-len", "32", "--eval-every", "1", "--save-every", "1", *extra]

    assert cli_main(argv(2, "--device", "cpu")) == 0
    assert latest_checkpoint(out).name == "step_00000002"
    assert cli_main(argv(4, "--resume")) == 0
    assert latest_checkpoint(out).name == "step_00000004"
    assert cli_main(argv(2)) == 2  # a second fresh run into the same folder is refused
    assert "already holds checkpoints" in capsys.readouterr().err
    assert cli_main(["plot", str(out)]) == 0 and (out / "loss.png").is_file()


@pytest.mark.parametrize("damage,expected", [
    (lambda ckpt: (ckpt / "model.safetensors").unlink(), "model.safetensors is missing"),
    (lambda ckpt: (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:5000]),
     "model.safetensors: unreadable safetensors file"),
    (lambda ckpt: (ckpt / "model.safetensors").write_bytes(b"\x00" * 64), "unreadable safetensors file"),
    (lambda ckpt: (ckpt / "config.json").write_text(
        (ckpt / "config.json").read_text().replace('"hidden_size": 128', '"hidden_size": 96')),
     "weights do not match"),
    (lambda ckpt: (ckpt / STATE_FILE).write_bytes(b"garbage"), "unreadable trainer state"),
])
def test_resume_from_a_damaged_checkpoint_is_one_line(dataset: Path, tmp_path: Path, capsys, damage, expected):
    out = tmp_path / "run"

    def argv(steps: int, *extra: str) -> list[str]:
        return ["train", "--config", "tiny", "--data", str(dataset), "--out", str(out), "--steps", str(steps),
                "--batch-size", "2", "--seq-len", "32", "--eval-every", "0", "--save-every", "1", *extra]

    assert cli_main(argv(1)) == 0
    damage(latest_checkpoint(out))
    capsys.readouterr()
    assert cli_main(argv(2, "--resume")) == 2  # the checksums catch it first
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fail verification" in err[0] and "--no-verify" in err[0], err
    assert cli_main(argv(2, "--resume", "--no-verify")) == 2  # and without them, the loader names it
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and str(latest_checkpoint(out)) in err[0], err


def test_resume_verifies_the_checkpoint_it_wrote(dataset: Path, tmp_path: Path, capsys):
    """Flipped weight bytes (still a readable file): resume refuses, naming the file, instead of training on and
    writing fresh checksums that bless the damage; --no-verify is the user's explicit choice."""
    out = tmp_path / "run"
    argv = ["train", "--config", "tiny", "--data", str(dataset), "--out", str(out), "--batch-size", "2", "--seq-len",
            "32", "--eval-every", "0", "--save-every", "1"]
    assert cli_main(argv + ["--steps", "1"]) == 0
    weights = latest_checkpoint(out) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli_main(argv + ["--steps", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{weights}: sha256 differs" in err and "--no-verify" in err
    assert latest_checkpoint(out).name == "step_00000001"  # nothing trained, nothing written
    assert cli_main(argv + ["--steps", "2", "--resume", "--no-verify"]) == 0
    assert latest_checkpoint(out).name == "step_00000002"


def test_partial_checkpoint_folders_are_removed_at_start(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    partial = out / "checkpoints" / ".tmp_step_00000007_12345"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"half")
    _fit(dataset, out, steps=1)
    assert not partial.exists() and latest_checkpoint(out).name == "step_00000001"


def test_init_fine_tunes_a_checkpoint_from_its_own_weights(dataset: Path, tmp_path: Path) -> None:
    """`train --init`: a run trained here, then saved in the official FP8/FP4 layout, fine-tuned from that file; the
    fine-tuning model starts at the checkpoint's values (dequantized, as fp32 master weights), its first evaluation
    is the checkpoint's own loss, and training lowers it. Data of another tokenizer is refused."""
    from openflash.checkpoint import load_checkpoint, save_checkpoint
    from openflash.files.run_dir import latest_checkpoint

    base, _ = _fit(dataset, tmp_path / "base", steps=6, eval_every=0)
    stored = save_checkpoint(base.model, tmp_path / "fp8", dtype="fp8", tokenizer_json=dataset / "tokenizer.json")
    want, _ = load_checkpoint(stored, weights="dequantized")
    tuned, _ = _fit(dataset, tmp_path / "tuned", init=str(stored), steps=8, eval_every=0, lr=1e-3)
    start = open_model(str(latest_checkpoint(tmp_path / "tuned")), placement=Placement(weights="dequantized"))
    assert all(p.dtype == torch.float32 for p in tuned.model.parameters())  # fp32 master weights
    lines = [json.loads(x) for x in (tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["val_loss"] for r in lines if "val_loss" in r]
    with torch.no_grad():
        base = Runtime.of(want, load_tokenizer(dataset / "tokenizer.json"))
        base_loss = sum(float(base.forward(x, y).loss) * y.numel() for x, y in tuned.eval_set) / \
            sum(y.numel() for _, y in tuned.eval_set)
    # The checkpoint's own loss (the trainer evaluates under the train numerics, the loaded FP8 model under fp32).
    assert abs(evals[0] - base_loss) < 0.01 * base_loss, (evals, base_loss)
    assert len(evals) == 2 and evals[-1] < evals[0]
    from openflash.model.layers import Linear
    from openflash.model.numerics import TRAIN
    from openflash.train.dataset import TokenDataset
    from openflash.train.finetune import init_model

    fresh, _, _ = init_model(str(stored), TokenDataset(dataset, "train"), TRAIN)
    linears = [(n, m) for n, m in want.named_modules() if isinstance(m, Linear)]
    assert linears and all(torch.equal(fresh.get_submodule(n).weight, m.dequantized_weight()) for n, m in linears)
    assert start.cfg.weight_dtype == "fp32" and start.cfg.vocab_size == want.cfg.vocab_size
    other = tmp_path / "other_data"
    files = make_corpus(tmp_path / "other_corpus", files=6)
    train_bpe_tokenizer(files, 400, tmp_path / "other_tok.json")
    prepare_dataset([tmp_path / "other_corpus"], tmp_path / "other_tok.json", other, val_fraction=0.2, progress=False)
    with pytest.raises(OpenflashError, match="prepared with another tokenizer"):
        _fit(other, tmp_path / "refused", init=str(stored), steps=2)


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """The run's TensorBoard scalars as tensorboard's own reader reads them: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_are_the_metrics_lines_and_a_resume_drops_the_steps_it_redoes(dataset: Path,
                                                                                         tmp_path: Path) -> None:
    out = tmp_path / "run"
    _fit(dataset, out, steps=4, save_every=2, eval_every=2, keep_checkpoints=2)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scalars = _scalars(out)
    train = [r for r in lines if "loss" in r]
    assert scalars["train/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in train]
    for key in ("lr", "grad_norm", "tokens_per_s"):
        assert [s for s, _ in scalars[f"train/{key}"]] == [1, 2, 3, 4]
    assert [s for s, _ in scalars["eval/val_loss"]] == [r["step"] for r in lines if "val_loss" in r]
    # a run that stopped after logging step 4 but saving only step 2 (its step-4 checkpoint gone) resumes at 2: the
    # events of steps 3 and 4 written before are dropped, as their metrics lines are, and written again
    import shutil

    shutil.rmtree(out / "checkpoints" / "step_00000004")
    _fit(dataset, out, steps=6, save_every=2, eval_every=2, keep_checkpoints=2, resume=True)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    again = _scalars(out)
    assert again["train/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in lines if "loss" in r]
    assert [s for s, _ in again["train/loss"]] == [1, 2, 3, 4, 5, 6]
    none = tmp_path / "quiet"
    _fit(dataset, none, steps=1, log_to=())
    assert not (none / "tensorboard").exists() and (none / "metrics.jsonl").is_file()


def test_log_to_names_what_it_takes(capsys: pytest.CaptureFixture) -> None:
    from openflash.files.metric_sinks import parse_log_to

    assert parse_log_to("tensorboard") == ("tensorboard",) and parse_log_to("none") == ()
    for bad, said in (("wandb", "wandb sync --sync-tensorboard"), ("tb", "expected tensorboard or none"),
                      ("none,tensorboard", "expected tensorboard or none")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            parse_log_to(bad)
    with pytest.raises(SystemExit):
        cli_main(["train", "--data", "d", "--out", "o", "--log-to", "wandb"])
    assert "--log-to" in capsys.readouterr().err
