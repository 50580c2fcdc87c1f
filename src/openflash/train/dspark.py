"""Training the DSpark drafter on a trained model, the backbone frozen: `openflash train --dspark --init RUN`.

Per step, for a batch of sequences: the frozen target runs once (its logits and the drafter's input, main_hidden,
for every position); then `anchors` random positions p per sequence each get a draft block [x_{p+1}, noise...] at
positions p+1..p+B, whose stage rings hold the target's KV of positions p-W+1..p (as at inference), and whose
Markov rows are conditioned on the true previous token (teacher forcing). Row i predicts x_{p+2+i}.

    loss = sum_i w_i CE(draft_i, x_{p+2+i}) / sum_i w_i           w_i = exp(-i / gamma)
         + l1_weight * mean_i |q_i - p_i|_1                         q: draft softmax, p: target softmax at p+1+i
         + confidence_weight * BCE(sigmoid(c_i), 1 - TV(q_i, p_i))  TV = |q - p|_1 / 2, no gradient

UNCERTAIN: the DSpark recipe as public sources describe it (position-decayed cross-entropy, a distribution
matching term, a confidence head regressed on agreement); gamma, the weights, the use of L1 rather than a KL and
teacher-forced Markov rows are this implementation's choices (defaults below), not published values.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from openflash.checkpoint import build_model, checkpoint_folder, save_checkpoint
from openflash.errors import OpenflashError
from openflash.files.run_dir import ARGS_FILE
from openflash.memory.tokenmap import find_token_map_file
from openflash.model import dspark
from openflash.model.cache import ModelCache
from openflash.model.context import StepContext
from openflash.model.stores import WindowCache
from openflash.model.transformer import Transformer
from openflash.runtime.open import open_model
from openflash.runtime.placement import Placement
from openflash.runtime.runtime import Runtime
from openflash.train.dataset import BatchLoader, TokenDataset

log = logging.getLogger("openflash.train")


@dataclass
class DraftTrainConfig:
    init: str  # a trained run folder (its latest checkpoint) or a checkpoint folder
    out: str  # the checkpoint folder written: the model with its drafter
    data: str | None = None  # prepared data (default: the run's own --data)
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    anchors: int = 32  # draft blocks per sequence per step
    lr: float = 3e-3
    gamma: float = 2.0
    l1_weight: float = 1.0
    confidence_weight: float = 0.1
    seed: int = 0
    max_minutes: float | None = None
    device: str = "auto"  # placement.resolve_device: the first CUDA device where there is one


@dataclass
class DraftLoss:
    total: torch.Tensor
    ce: float
    l1: float
    bce: float
    greedy_agreement: float  # argmax(q) == argmax(p), the chance a greedy draft is kept (per position)
    overlap: float  # sum min(p, q), the chance a sampled draft is kept (per position)


def _data_dir(cfg: DraftTrainConfig) -> Path:
    if cfg.data is not None:
        return Path(cfg.data)
    for folder in (Path(cfg.init), Path(cfg.init).parent.parent):  # a run folder, or one of its checkpoints
        args = folder / ARGS_FILE
        if args.is_file():
            data = json.loads(args.read_text()).get("data")
            if data:
                return Path(data)
    raise OpenflashError(f"--init {cfg.init}: no {ARGS_FILE} saying where its data is; pass --data")


def drafter_model(init: str, device: str = "auto") -> Runtime:
    """The trained model of `init` (a checkpoint or a run folder) on `device` with a DSpark head (new, random,
    unless it has one), only the head trainable."""
    runtime = open_model(str(checkpoint_folder(init)), numerics="train",
                         placement=Placement(device=device, weights="dequantized"))
    model = runtime.model
    cfg = model.cfg if model.cfg.dspark is not None else model.cfg.with_dspark()
    if cfg is not model.cfg:
        torch.manual_seed(0)
        drafted = build_model(cfg, "train", device=model.device)
        missing, unexpected = drafted.load_state_dict(model.state_dict(), strict=False)
        if unexpected or any(not k.startswith("mtp.") for k in missing):
            raise OpenflashError(f"{init}: cannot add a drafter: unexpected {unexpected[:3]}, missing "
                                 f"{[k for k in missing if not k.startswith('mtp.')][:3]}")
        model = drafted
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    return runtime.with_model(model.eval())


def drafter_loss(model: Transformer, tokens: torch.Tensor, target_logits: torch.Tensor, main_hidden: torch.Tensor,
                 anchors: torch.Tensor, cfg: DraftTrainConfig) -> DraftLoss:
    """The loss of the draft blocks after `anchors` [B, A] (positions p; see the module docstring)."""
    d, W = model.cfg.dspark, model.cfg.sliding_window
    size = d.block_size
    B, A = anchors.shape
    dev = tokens.device
    rows = torch.arange(B, device=dev).unsqueeze(1)
    block = torch.arange(size, device=dev)
    x = dspark.main_x(model.mtp, main_hidden)
    positions = torch.arange(tokens.shape[1], device=dev).expand(B, -1)
    ring_pos = anchors.unsqueeze(-1) - W + 1 + torch.arange(W, device=dev)  # [B, A, W]: positions p-W+1 .. p
    valid = ring_pos >= 0
    rings = []
    for stage in model.mtp:
        kv = stage.attn.target_kv(x, positions)  # [B, S, head_dim], with gradient
        ring_kv = kv[rows.unsqueeze(-1), ring_pos.clamp(min=0)] * valid.unsqueeze(-1)
        rings.append(WindowCache(ring_kv.flatten(0, 1), torch.where(valid, ring_pos, -1).flatten(0, 1)))
    block_pos = (anchors.unsqueeze(-1) + 1 + block).flatten(0, 1)  # [N, size]
    cache = ModelCache(pos=block_pos[:, 0], window=[], compressed={}, engram=None, draft=rings)
    ctx = StepContext(block_pos, model.numerics, cache=cache)
    truth = tokens[rows.unsqueeze(-1), anchors.unsqueeze(-1) + 2 + block].flatten(0, 1)  # [N, size]
    anchor_ids = tokens[rows, anchors + 1].flatten()
    residual, pre = model.streams(dspark.block_ids(anchor_ids, size, d.noise_token_id))
    draft = dspark.draft_block(model.head, model.mtp, anchor_ids, residual, pre, ctx,
                               choose=lambda logits, i: truth[:, i])
    target = target_logits[rows.unsqueeze(-1), anchors.unsqueeze(-1) + 1 + block].flatten(0, 1)
    p = torch.softmax(target.float(), dim=-1)
    log_q = F.log_softmax(draft.logits, dim=-1)
    q = log_q.exp()
    weights = torch.exp(-block.float() / cfg.gamma)
    ce = (F.nll_loss(log_q.flatten(0, 1), truth.flatten(), reduction="none").view(-1, size).mean(0) * weights).sum()
    ce = ce / weights.sum()
    l1 = (q - p).abs().sum(-1)
    agreement = (1.0 - 0.5 * l1).detach().clamp(0.0, 1.0)
    bce = F.binary_cross_entropy_with_logits(draft.confidence, agreement)
    total = ce + cfg.l1_weight * l1.mean() + cfg.confidence_weight * bce
    greedy = (draft.logits.argmax(-1) == target.argmax(-1)).float().mean()
    overlap = torch.minimum(p, q).sum(-1).mean()
    return DraftLoss(total, float(ce), float(l1.mean()), float(bce), float(greedy), float(overlap))


def train_drafter(cfg: DraftTrainConfig) -> dict:
    """Train the drafter of `cfg.init` for cfg.steps (or cfg.max_minutes) and write the model to cfg.out."""
    runtime = drafter_model(cfg.init, cfg.device)
    model, source = runtime.model, runtime.folder
    data = TokenDataset(_data_dir(cfg), "train")
    if data.vocab_size != model.cfg.vocab_size:
        raise OpenflashError(f"{data}: vocabulary {data.vocab_size} but the model has {model.cfg.vocab_size}")
    size = model.cfg.dspark.block_size
    if cfg.seq_len < size + 3:
        raise OpenflashError(f"--seq-len {cfg.seq_len} is too short for draft blocks of {size}")
    loader = BatchLoader(data, cfg.batch_size, cfg.seq_len, cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    start, history = time.perf_counter(), []
    for step in range(cfg.steps):
        if cfg.max_minutes is not None and time.perf_counter() - start > 60 * cfg.max_minutes:
            break
        lr = cfg.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / cfg.steps)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        tokens = loader.batch_at(step)[0].to(model.device)
        with torch.no_grad():
            out = runtime.forward(tokens, hidden=True)
        anchors = torch.randint(0, cfg.seq_len - size - 2, (tokens.shape[0], cfg.anchors), generator=gen)
        anchors = anchors.to(model.device)
        loss = drafter_loss(model, tokens, out.logits, out.main_hidden, anchors, cfg)
        optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        record = {"step": step + 1, "loss": float(loss.total), "ce": loss.ce, "l1": loss.l1, "bce": loss.bce,
                  "greedy_agreement": loss.greedy_agreement, "overlap": loss.overlap,
                  "seconds": round(time.perf_counter() - start, 1)}
        history.append(record)
        if step % 10 == 0 or step + 1 == cfg.steps:
            log.info("drafter step %d: loss %.3f (ce %.3f, l1 %.3f, bce %.3f), greedy agreement %.2f, overlap %.2f",
                     step + 1, record["loss"], loss.ce, loss.l1, loss.bce, loss.greedy_agreement, loss.overlap)
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"config": asdict(cfg), "steps": len(history), "first": history[0] if history else None,
               "last": history[-1] if history else None}
    (out_dir / "drafter_train.json").write_text(json.dumps({**summary, "history": history}, indent=1))
    map_file = find_token_map_file(source)
    if map_file is not None:
        shutil.copy(map_file, out_dir / map_file.name)
    tokenizer = source / "tokenizer.json"
    save_checkpoint(model, out_dir, dtype="fp32", tokenizer_json=tokenizer if tokenizer.is_file() else None)
    return summary
