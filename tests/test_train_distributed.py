"""Data-parallel training: 2 CPU processes (gloo) agree with 1 process on the same global batch.

What must agree, and how closely: the ranks' gradients are averaged after backward, so their sums run in another
order than in one process, and each rank's matmuls see half the rows (the BLAS may pick other kernels). So the first
step's reduced gradients and the losses agree to fp32 summation error, not bitwise. Weights after a step are not
compared: Adam's first update is about lr * sign(g), so a gradient entry near zero whose sign flips on rounding moves
its weight by 2 lr (seen on an AVX2 machine); and the model's discrete choices (expert routing, index top-k, FP8
rounding of activations) can flip at near-ties once weights differ. The tiny preset runs with every expert and every
compressed entry selected, so the first step has no routing choice to flip.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from openflash.config import load_config
from openflash.files.peft import read_adapter
from openflash.train.data_parallel import fit_data_parallel, reduced_gradients
from openflash.train.prepare import prepare_dataset
from openflash.train.tokenizer import train_bpe_tokenizer
from openflash.train.trainer import TrainConfig, Trainer


def make_dataset(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for i in range(10):
        body = "".join(f"def f_{i}_{j}(a, b={j}):\n    return a * {j} - b + {i}\n\n" for j in range(25))
        (corpus / f"m{i}.py").write_text("import math\n\n" + body)
    train_bpe_tokenizer(sorted(corpus.iterdir()), 400, root / "tokenizer.json")
    prepare_dataset([corpus], root / "tokenizer.json", root / "data", val_fraction=0.2, progress=False)
    return root / "data"


def one_process(cfg: TrainConfig) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The run in this process with one thread, as each rank runs: its records and first step's gradients."""
    records: list[dict] = []
    grads: dict[str, torch.Tensor] = {}

    def on_step(trainer: Trainer, record: dict) -> None:
        records.append(record)
        if record["step"] == 1:
            grads.update(reduced_gradients(trainer))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(cfg, on_step=on_step).fit()
    finally:
        torch.set_num_threads(threads)
    return records, grads


def test_two_processes_match_one(tmp_path: Path) -> None:
    data = make_dataset(tmp_path)
    smooth = load_config("tiny").replace(num_experts_per_tok=8, index_topk=32, candidate_topk_blocks=8)
    smooth.save(tmp_path / "smooth.json")
    args = dict(config=str(tmp_path / "smooth.json"), data=str(data), steps=2, batch_size=4, seq_len=32, warmup=1,
                lr=1e-3, eval_every=0, eval_batches=1, progress=False)
    single_records, single_grads = one_process(TrainConfig(**args, out=str(tmp_path / "one")))
    multi = fit_data_parallel(TrainConfig(**args, out=str(tmp_path / "two")), world_size=2,
                              first_step_grads=tmp_path / "grads.pt")
    multi_grads = torch.load(tmp_path / "grads.pt")

    assert multi["step"] == 2 and len(multi["records"]) == 2
    assert single_grads.keys() == multi_grads.keys() and single_grads
    for name, g in single_grads.items():
        # fp32 sums over 2 x 64 tokens in another order: relative error ~1e-6 of the gradient's norm; 1e-4 leaves
        # room for the odd FP8 activation rounding flip and still catches a missing or doubled rank (error ~1).
        err = float((multi_grads[name] - g).norm())
        assert err <= 1e-4 * float(g.norm()) + 1e-9, (name, err, float(g.norm()))
    for a, b in zip(single_records, multi["records"]):
        assert abs(a["loss_exact"] - b["loss_exact"]) < 1e-5, (a["loss_exact"], b["loss_exact"])
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * max(1.0, a["grad_norm"])
        assert a["load_max_mean"] == b["load_max_mean"]  # expert loads were summed over the ranks
    # Only rank 0 wrote the run folder (one TensorBoard event file: files/metric_sinks.py).
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["checkpoints", "config.json", "metrics.jsonl",
                                                                     "tensorboard", "train_args.json"]
    assert len(list((tmp_path / "two" / "tensorboard").iterdir())) == 1


def _lora_base(tmp_path: Path) -> tuple[Path, Path]:
    """(prepared data, a checkpoint of the smooth tiny config in the official FP8/FP4 layout)."""
    from openflash.checkpoint import build_model, save_checkpoint
    from openflash.train.trainer import training_model_config

    data = make_dataset(tmp_path)
    smooth = load_config("tiny").replace(num_experts_per_tok=8, index_topk=32, candidate_topk_blocks=8)
    smooth.save(tmp_path / "smooth.json")
    torch.manual_seed(0)
    base = save_checkpoint(build_model(training_model_config(tmp_path / "smooth.json", tmp_path / "tokenizer.json")),
                           tmp_path / "base", dtype="fp8", tokenizer_json=tmp_path / "tokenizer.json")
    return data, base


def test_lora_sharded_over_two_processes_matches_one(tmp_path: Path) -> None:
    """`train --lora` under torchrun: the frozen FP8/FP4 base and the adapters sharded with FSDP2 (train/sharded.py);
    the first step's gradients (gathered whole), the losses and the saved adapter equal one process's within fp32
    summation error."""
    data, base = _lora_base(tmp_path)
    args = dict(init=str(base), lora=4, data=str(data), steps=2, batch_size=4, seq_len=32, warmup=1, lr=1e-3,
                eval_every=0, eval_batches=1, progress=False)
    single_records, single_grads = one_process(TrainConfig(**args, out=str(tmp_path / "one")))
    multi = fit_data_parallel(TrainConfig(**args, out=str(tmp_path / "two")), world_size=2,
                              first_step_grads=tmp_path / "grads.pt")
    multi_grads = torch.load(tmp_path / "grads.pt")
    assert single_grads.keys() == multi_grads.keys() and all(".adapter.lora_" in n for n in single_grads)
    for name, g in single_grads.items():
        err = float((multi_grads[name] - g).norm())
        assert err <= 1e-4 * float(g.norm()) + 1e-9, (name, err, float(g.norm()))
    for a, b in zip(single_records, multi["records"]):
        assert abs(a["loss_exact"] - b["loss_exact"]) < 1e-5, (a["loss_exact"], b["loss_exact"])
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "step_00000002").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "base_model.json", "checksums.sha256", "tokenizer.json",
        "trainer_state.pt"]
    one, two = (read_adapter(tmp_path / run / "checkpoints" / "step_00000002").weights for run in ("one", "two"))
    assert one.keys() == two.keys()
    for name, (a, b) in one.items():  # two Adam steps: about lr * sign(g) each, signs of near-zero entries may flip
        assert float((two[name][0] - a).abs().max()) <= 2.5e-3 and float((two[name][1] - b).abs().max()) <= 2.5e-3


def test_a_sharded_lora_run_resumes_where_it_stopped(tmp_path: Path) -> None:
    """A sharded run saves its adapters and its optimizer state whole; resumed (sharded again) from step 2, its step
    3 equals the uninterrupted run's."""
    data, base = _lora_base(tmp_path)
    args = dict(init=str(base), lora=4, data=str(data), steps=3, batch_size=4, seq_len=32, warmup=1, lr=1e-3,
                eval_every=0, eval_batches=1, save_every=2, keep_checkpoints=2, progress=False)
    fit_data_parallel(TrainConfig(**args, out=str(tmp_path / "whole")), world_size=2)
    (tmp_path / "cut" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step_00000002", tmp_path / "cut" / "checkpoints" /
                    "step_00000002")
    for name in ("config.json", "train_args.json", "metrics.jsonl"):
        shutil.copy(tmp_path / "whole" / name, tmp_path / "cut" / name)
    resumed = fit_data_parallel(TrainConfig(**args, out=str(tmp_path / "cut"), resume=True), world_size=2)
    assert resumed["step"] == 3 and len(resumed["records"]) == 1
    whole, cut = (read_adapter(tmp_path / run / "checkpoints" / "step_00000003").weights for run in ("whole", "cut"))
    for name, (a, b) in whole.items():
        torch.testing.assert_close(cut[name][0], a, rtol=0, atol=1e-6)
        torch.testing.assert_close(cut[name][1], b, rtol=0, atol=1e-6)
