"""Fine-tuning a model with a vision tower on image+text pairs: `openflash train --vision-data pairs.jsonl --init M`.

The data is JSON Lines, one example per line, paths relative to the file:

    {"image": "cat.png", "text": "A cat on a mat."}
    {"images": ["a.png", "b.png"], "prompt": "Compare <image> with <image>:", "text": " the first is darker."}

`image` / `images`: the example's images; `prompt` (optional): text the model is conditioned on but not trained to
produce, where each `<image>` takes the next image (without any, the images come first); `text`: the target text
(an end-of-sequence token follows it). The loss is the next-token cross-entropy on the target text only
(never on image positions, prompt, or padding).

Every weight trains (ViT and aligner included, unless `freeze_vision`), through the model's own forward: the ViT
runs inside autograd on each step's images. Router biases stay as loaded (no load balancing during fine-tuning).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from openflash.checkpoint import save_checkpoint
from openflash.errors import OpenflashError
from openflash.files.jsonl import jsonl_records
from openflash.model.transformer import Transformer
from openflash.model.vision import ImageRows
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.train.optim import Schedule
from openflash.vision.prompt import IMAGE_PLACEHOLDER, PromptImage, text_prompt

log = logging.getLogger("openflash.train")


@dataclass
class VLExample:
    ids: list[int]
    images: list[PromptImage]
    target_from: int  # first position whose token is a training target (the target text starts there)


def read_pairs(path: str | Path, model_cfg, tokenizer: Tokenizer, max_len: int) -> list[VLExample]:
    """The examples of a JSONL file (format in the module doc); OpenflashError naming the file and line."""
    path = Path(path)
    if model_cfg.vision is None:
        raise OpenflashError("this model has no vision tower (vision_config.num_hidden_layers = 0): --vision-data "
                             "needs one")
    examples = []
    for where, record in jsonl_records(path):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise OpenflashError(f"{where}: each line must be an object with a string 'text'")
        images = record.get("images", [record["image"]] if "image" in record else [])
        if not isinstance(images, list) or not images or not all(isinstance(p, str) for p in images):
            raise OpenflashError(f"{where}: 'image' (a path) or 'images' (a list of paths) is required")
        prompt = record.get("prompt", "")
        if not isinstance(prompt, str):
            raise OpenflashError(f"{where}: 'prompt' must be a string")
        text = record["text"]
        paths = [path.parent / p for p in images]
        if IMAGE_PLACEHOLDER in text:
            raise OpenflashError(f"{where}: images go in 'prompt' (or first), not in the target 'text'")
        try:
            ids, placed = text_prompt(tokenizer, prompt, paths, model_cfg)
        except OpenflashError as exc:
            raise OpenflashError(f"{where}: {exc}") from None
        target_from = len(ids)
        ids += tokenizer.encode(text, add_special_tokens=False).ids
        ids.append(model_cfg.eos_token_id)
        if len(ids) > max_len:
            raise OpenflashError(f"{where}: {len(ids)} tokens (images included), over --seq-len {max_len}")
        examples.append(VLExample(ids, placed, target_from))
    if not examples:
        raise OpenflashError(f"{path}: no examples")
    return examples


def vl_batch(examples: list[VLExample], model: Transformer,
             pad_id: int) -> tuple[torch.Tensor, torch.Tensor, ImageRows]:
    """Inputs and targets [B, S] (right-padded; -100 where nothing is learned) and the batch's image rows."""
    S = max(len(e.ids) for e in examples) - 1
    inputs = torch.full((len(examples), S), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), S), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), S, dtype=torch.bool)
    rows = []
    for b, e in enumerate(examples):
        n = len(e.ids) - 1
        inputs[b, :n] = torch.tensor(e.ids[:-1])
        target = torch.tensor(e.ids[1:])
        learn = torch.arange(1, n + 1) >= e.target_from
        for img in e.images:  # positions whose next token lies in an image span learn nothing
            learn &= ~((torch.arange(1, n + 1) >= img.start) & (torch.arange(1, n + 1) < img.end))
        targets[b, :n] = torch.where(learn, target, torch.full_like(target, -100))
        for img in e.images:  # in position order: ImageRows wants row-major mask order
            mask[b, img.start:img.end] = True
            im = img.image
            rows.append(model.encode_image(im.patches, im.grid.n_vit_h, im.grid.n_vit_w, im.types))
    device = model.device
    return inputs.to(device), targets.to(device), ImageRows(mask.to(device), torch.cat(rows))


@dataclass
class VLTrainConfig:
    data: str  # the JSONL file
    init: str  # a preset (random weights), a checkpoint folder or a training run folder
    out: str  # the checkpoint folder written
    steps: int = 100
    batch_size: int = 4
    seq_len: int = 1024
    lr: float = 1e-3
    freeze_vision: bool = False
    seed: int = 0
    max_minutes: float | None = None
    device: str = "auto"  # placement.resolve_device: the first CUDA device where there is one


def train_vision(cfg: VLTrainConfig) -> dict:
    """Fine-tune `cfg.init` on the pairs of `cfg.data` and write the model to `cfg.out`; returns a summary with
    the loss history."""
    for name in ("steps", "batch_size", "seq_len"):
        if getattr(cfg, name) < 1:
            raise OpenflashError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    runtime = open_model(cfg.init, numerics="train", placement=Placement(device=cfg.device, weights="dequantized"))
    model, tokenizer, source = runtime.model, runtime.tokenizer, runtime.folder
    examples = read_pairs(cfg.data, model.cfg, tokenizer, cfg.seq_len)
    for name, p in model.named_parameters():
        p.requires_grad_(not (cfg.freeze_vision and name.startswith(("vision.", "aligner."))))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    schedule = Schedule(warmup=min(10, cfg.steps), total=cfg.steps)  # the trainer's: warm-up, cosine to 10%
    model.train()
    start, history = time.perf_counter(), []
    for step in range(cfg.steps):
        if cfg.max_minutes is not None and time.perf_counter() - start > 60 * cfg.max_minutes:
            break
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * schedule.multiplier(step)
        picks = torch.randint(0, len(examples), (min(cfg.batch_size, len(examples)),), generator=gen).tolist()
        inputs, targets, images = vl_batch([examples[i] for i in picks], model, model.cfg.pad_token_id)
        out = runtime.forward(inputs, targets, images=images)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        loss = float(out.loss.detach())
        if not math.isfinite(loss):
            raise OpenflashError(f"the loss became {loss} at step {step + 1}; lower --lr (now {cfg.lr})")
        history.append({"step": step + 1, "loss": loss, "seconds": round(time.perf_counter() - start, 2)})
        if step % 10 == 0 or step + 1 == cfg.steps:
            log.info("vision fine-tune step %d: loss %.3f", step + 1, loss)
    model.eval()
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"config": asdict(cfg), "examples": len(examples), "steps": len(history),
               "first": history[0] if history else None, "last": history[-1] if history else None}
    (out_dir / "vision_train.json").write_text(json.dumps({**summary, "history": history}, indent=1))
    tok_file = source / "tokenizer.json" if source is not None else None
    if tok_file is None or not tok_file.is_file():
        tok_file = out_dir / "tokenizer.json.tmp"
        tokenizer.save(str(tok_file))
    save_checkpoint(model, out_dir, dtype="fp32", tokenizer_json=tok_file)
    if tok_file.name.endswith(".tmp"):
        tok_file.unlink()
    return summary


__all__ = ["VLExample", "VLTrainConfig", "read_pairs", "vl_batch", "train_vision"]
