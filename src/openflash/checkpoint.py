"""Checkpoints in the official layout: load and save (spec: checkpoint.md).

Tensor names are the reference module names (`layers.3.attn.wq_b.weight`, `.scale`, `layers.1.engram.embed.weight`,
...), which are also this package's module names, so loading is 1:1. What changes on load is only the dtype:
quantized tensors (FP8 E4M3 + UE8M0 block scales, packed FP4 experts as I8, FP8 Engram rows) stay quantized;
bf16/f32 tensors become fp32 parameters (bf16 matrices stay bf16 under `weights="stored"`); `attn.wo_a` is
dequantized once (the reference's convert step). A folder holds `config.json` and either `model.safetensors` or
shards with `model.safetensors.index.json`; each tensor is read once, by positioned reads at the offsets its
safetensors header gives (shards.py; no file is mapped).

Loading checks every name, shape and dtype and reports all problems at once. The vision tower (`vision.*`,
`aligner.*`, `image_start` / `image_end` / `image_newline`) loads like the rest, bf16 promoted to fp32.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from openflash import formats
from openflash.config import FlashConfig, load_config
from openflash.errors import CheckpointError
from openflash.files.atomic import write_text_atomic
from openflash.files.hub import hub_snapshot, looks_like_repo_id
from openflash.files.manifest import verify_manifest, write_manifest
from openflash.files.run_dir import latest_checkpoint
from openflash.files.shards import INDEX_FILE, SINGLE_FILE, ShardReader, tensor_locations
from openflash.memory.frontend import EngramFrontend
from openflash.memory.tokenmap import TokenMap, find_token_map_file
from openflash.model.numerics import NUMERICS, Numerics
from openflash.model.transformer import WEIGHT_RESIDENCIES, Transformer
from openflash.residency import bf16_matrices, choose_residency
from openflash.tokenizer import DEEPSEEK, load_tokenizer

log = logging.getLogger("openflash.checkpoint")

VISION_PREFIXES = ("vision.", "aligner.", "image_start", "image_end", "image_newline")

_TORCH_TO_ST = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8",
                torch.uint8: "U8", torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
_FLOAT_ST = ("BF16", "F32", "F16")
# Official storage of the dense linears that the release keeps in FP8 with 32x32 UE8M0 blocks (checkpoint.md §3).
_FP8_LINEAR = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv"
                         r"|mtp\.0\.main_proj)\.weight$")
_FP4_EXPERT = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
# Tensors a text-only writer leaves out of a config that has a vision tower: (pattern, why zeros are right).
_ZERO_IF_ABSENT = ((re.compile(r"ffn\.gate\.bias_vl$"), "the router's image-token bias; zeros route images like text"),)
_ROUTED_EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.")  # the backbone's (not the DSpark stages')
_F32_NAMES = re.compile(r"(attn_sink|gate\.bias|gate\.bias_vl|hc_(attn|ffn)_(fn|base|scale))$")


@dataclass
class LoadReport:
    path: Path
    tensors: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # part left unread -> tensor count
    residency: str = "dequantized"  # weight residency the model runs with (Transformer.set_weight_residency)
    tokenizer: Tokenizer | None = None  # the checkpoint's tokenizer.json, else the DeepSeek tokenizer
    tokenizer_source: str = ""  # which tokenizer that is, for error messages
    engram_frontend: EngramFrontend | None = None  # token map (its own file, else the tokenizer's) and hasher
    token_map_source: str = ""  # where the Engram token map came from (a file of the folder, or the tokenizer)

    def summary(self) -> str:
        text = f"{self.path}: loaded {self.tensors} tensors"
        if self.skipped:
            text += "; skipped " + ", ".join(f"{v} {k}" for k, v in self.skipped.items())
        text += f"; weights {self.residency}"
        return text + (f"; Engram token map {self.token_map_source}" if self.token_map_source else "")


# ---- reading -------------------------------------------------------------------------------------------------

class _TensorFiles:
    """name -> (file, dtype, shape) over a single file or an index of shards; tensors read on demand."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.where = tensor_locations(folder)
        self.reader = ShardReader()

    def names(self) -> list[str]:
        return list(self.where)

    def info(self, name: str) -> tuple[str, list[int]]:
        loc = self.where[name]
        return loc.dtype, list(loc.shape)

    def get(self, name: str) -> torch.Tensor:
        """The tensor, read with positioned reads (nothing is mapped: a file truncated later fails a read with
        a CheckpointError instead of a SIGBUS)."""
        return self.reader.read(self.where[name])

    def close(self) -> None:
        self.reader.close()


def _expected_dtype(tensor: torch.Tensor) -> str:
    return _TORCH_TO_ST.get(tensor.dtype, str(tensor.dtype))


def build_model(cfg: FlashConfig, numerics: str | Numerics = "fp32", *,
                device: str | torch.device = "cpu") -> Transformer:
    """The one way to assemble a model: a Transformer of `cfg` built on `device` (weights from torch's RNG; "meta"
    allocates nothing) with its numerics policy. Its Engram memory comes from the caller (memory/placement.py)."""
    with torch.device(device):
        model = Transformer(cfg)
    return model.set_numerics(NUMERICS[numerics] if isinstance(numerics, str) else numerics)


def checkpoint_folder(path: str | Path) -> Path:
    """A checkpoint folder as given, the latest checkpoint of a training run folder, or the local snapshot of a
    Hugging Face model id ('org/name', files/hub.py: offline, from the hub cache)."""
    folder = Path(path)
    if not folder.exists() and looks_like_repo_id(str(path)):
        folder = hub_snapshot(str(path))
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a checkpoint folder")
    if (folder / SINGLE_FILE).exists() or (folder / INDEX_FILE).exists():
        return folder
    latest = latest_checkpoint(folder)
    if latest is None:
        raise CheckpointError(f"{folder}: neither a checkpoint (no {SINGLE_FILE} or {INDEX_FILE}) nor a training run "
                              f"with checkpoints")
    return latest


def load_checkpoint(path: str | Path, *, device: str | torch.device = "cpu", numerics: str | Numerics = "fp32",
                    tokenizer_path: str | Path | None = None,
                    skip_engram_tables: bool = False, verify: bool = False,
                    weights: str = "dequantized", skip_experts: bool = False) -> tuple[Transformer, LoadReport]:
    """Build the model of a checkpoint folder (or of a training run folder's latest checkpoint) and load its
    weights; returns (model in eval mode, report with the tokenizer).

    skip_engram_tables: leave the Engram tables (`layers.N.engram.embed.*`, 189 GiB released) unread, on the meta
    device, for a host / disk / sharded tier to serve (memory/placement.py); their names and shapes are still checked.
    verify: first check every file against the folder's checksums.sha256 (manifest.py); off by default.
    skip_experts: leave the backbone's routed experts (`layers.N.ffn.experts.*`) unread, on the meta device, for an
    ExpertSource (memory/experts.py) to serve; their names, shapes and dtypes are still checked.
    weights: "dequantized" (bf16 tensors promoted to fp32, FP8/FP4 linears cached in fp32 at first use) or
    "stored" (only the stored bytes resident: bf16 matrices stay bf16, linears dequantize tile by tile); "auto"
    picks "stored" when the dequantized copies would not fit comfortably in memory, or where the native kernels
    decode a quantized model of this width faster (`choose_residency`).
    """
    folder = checkpoint_folder(path)
    if verify:
        verify_manifest(folder)
    cfg = load_config(folder)
    files = _TensorFiles(folder)
    if tokenizer_path:
        tokenizer, tokenizer_source = load_tokenizer(tokenizer_path), f"--tokenizer {tokenizer_path}"
    elif (folder / "tokenizer.json").is_file():
        tokenizer, tokenizer_source = load_tokenizer(folder / "tokenizer.json"), str(folder / "tokenizer.json")
    else:
        tokenizer = load_tokenizer(DEEPSEEK)
        tokenizer_source = f"the DeepSeek tokenizer ({folder} has no tokenizer.json)"
    map_file = find_token_map_file(folder) if cfg.engram_layer_ids else None
    token_map = TokenMap.from_file(map_file, cfg) if map_file is not None else None
    map_source = "" if not cfg.engram_layer_ids else f"from {map_file.name}" if map_file is not None else \
        "derived from the tokenizer"
    if map_file is not None:
        log.info("%s: Engram token map read from %s (not derived from a tokenizer)", folder, map_file.name)
    model = build_model(cfg, numerics, device="meta")
    expected = model.state_dict()
    if weights == "auto":
        weights = choose_residency(model, device=device)
    if weights not in WEIGHT_RESIDENCIES:
        raise CheckpointError(f"weights must be one of {WEIGHT_RESIDENCIES} or auto, got {weights!r}")
    keep_bf16 = bf16_matrices(model) if weights == "stored" else set()
    report = LoadReport(folder, tokenizer=tokenizer, tokenizer_source=tokenizer_source,
                        engram_frontend=EngramFrontend.of(cfg, tokenizer, token_map), token_map_source=map_source)

    problems: list[str] = []
    present = set(files.names())
    zero_filled: list[str] = []
    state: dict[str, torch.Tensor] = {}
    if cfg.vision is not None and not any(n.startswith(VISION_PREFIXES) for n in present):
        raise CheckpointError(f"{folder}: config.json has a vision tower (vision_config.num_hidden_layers = "
                              f"{cfg.vision.num_hidden_layers}) but the checkpoint holds none of its tensors "
                              f"(vision.*, aligner.*, image_start/end/newline); a text-only copy needs "
                              f"vision_config.num_hidden_layers = 0")
    for name in sorted(present):
        if name not in expected and not (name.endswith("wo_a.scale") and name[:-5] + "weight" in expected):
            problems.append(f"unexpected tensor {name}")
    for name, meta in expected.items():
        if name not in present:
            if any(pattern.search(name) for pattern, _ in _ZERO_IF_ABSENT):
                state[name] = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
                zero_filled.append(name)
            else:
                problems.append(f"missing tensor {name}")
            continue
        dtype, shape = files.info(name)
        want_dtype = _expected_dtype(meta)
        if dtype == "U8" and want_dtype == "F8_E8M0":
            dtype = want_dtype  # UE8M0 scales stored as plain bytes by some writers: the same bits
        wo_a_fp8 = name.endswith("wo_a.weight") and dtype == "F8_E4M3"
        if list(meta.shape) != shape:
            problems.append(f"tensor {name} has shape {shape}, expected {list(meta.shape)}")
            continue
        if want_dtype == "F32" and meta.is_floating_point():
            if dtype not in _FLOAT_ST and not wo_a_fp8:
                problems.append(f"tensor {name} has dtype {dtype}, expected one of {', '.join(_FLOAT_ST)}")
                continue
        elif dtype != want_dtype:
            problems.append(f"tensor {name} has dtype {dtype}, expected {want_dtype}")
            continue
        if problems:
            continue  # keep validating, but stop reading tensors once the checkpoint is known to be bad
        if skip_engram_tables and ".engram.embed." in name:
            report.skipped["engram tables (left for an external tier)"] = \
                report.skipped.get("engram tables (left for an external tier)", 0) + 1
            continue
        if skip_experts and _ROUTED_EXPERT.match(name):
            report.skipped["routed expert tensors (left for an expert store)"] = \
                report.skipped.get("routed expert tensors (left for an expert store)", 0) + 1
            continue
        tensor = files.get(name)
        if wo_a_fp8:
            scale_name = name[:-len("weight")] + "scale"
            if scale_name not in present:
                problems.append(f"missing tensor {scale_name} (FP8 {name} needs its block scale)")
                continue
            tensor = formats.dequantize_fp8_blocks(tensor, files.get(scale_name))
            # The reference holds wo_a in bf16 after its convert step (exact for FP8 values).
            tensor = tensor.to(torch.bfloat16)
        if want_dtype == "F32" and meta.is_floating_point():
            if not (name in keep_bf16 and tensor.dtype == torch.bfloat16):
                tensor = tensor.to(torch.float32)
        elif want_dtype == "F8_E8M0" and tensor.dtype == torch.uint8:
            tensor = tensor.view(torch.float8_e8m0fnu)
        state[name] = tensor.to(device)
    files.close()
    if problems:
        shown = "\n  ".join(problems[:40])
        more = f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else ""
        raise CheckpointError(f"{folder}: checkpoint does not match the config ({len(problems)} problems):\n  "
                              f"{shown}{more}")
    if zero_filled:
        why = "; ".join(reason for pattern, reason in _ZERO_IF_ABSENT if any(pattern.search(n) for n in zero_filled))
        log.info("%s: %d tensors absent, set to zeros (%s), e.g. %s", folder, len(zero_filled), why, zero_filled[0])
    model.load_state_dict(state, assign=True, strict=not (skip_engram_tables or skip_experts))
    _materialize_runtime_buffers(model, device)
    model.set_weight_residency(weights)
    report.tensors = len(state)
    report.residency = weights
    return model.eval(), report


def _materialize_runtime_buffers(model: Transformer, device: str | torch.device) -> None:
    """Non-persistent buffers (statistics) are not in the checkpoint: create them on the target device."""
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None and buf.is_meta and name in module._non_persistent_buffers_set:
                module.register_buffer(name, torch.zeros(buf.shape, dtype=buf.dtype, device=device),
                                       persistent=False)


# ---- writing -------------------------------------------------------------------------------------------------

def stored_as_fp8_blocks(name: str) -> bool:
    """The official layout keeps this weight as FP8 codes with FP8_BLOCK-square UE8M0 scales (a dense linear)."""
    return _FP8_LINEAR.search(name) is not None


def stored_as_fp4(name: str) -> bool:
    """The official layout keeps this weight as MXFP4 (a routed expert's)."""
    return _FP4_EXPERT.search(name) is not None


def official_tensors(name: str, tensor: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The tensor(s) stored for one state_dict entry. dtype: fp32 (as trained), bf16, or fp8 (official layout:
    FP8 dense linears, FP4 routed experts, FP8 Engram rows, bf16 elsewhere, F32 for the fp32 params)."""
    t = tensor.detach().cpu()
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        return {name: t.contiguous()}  # already stored quantized (or integer)
    if dtype == "fp32" or _F32_NAMES.search(name):
        return {name: t.float().contiguous()}
    if dtype == "fp8":
        if stored_as_fp8_blocks(name):
            q, s = formats.quantize_fp8_blocks(t.float())
            return {name: q.view(torch.float8_e4m3fn), name[:-len("weight")] + "scale": s.view(torch.float8_e8m0fnu)}
        if stored_as_fp4(name):
            packed, s = formats.quantize_mxfp4(t.float())
            return {name: packed.view(torch.int8), name[:-len("weight")] + "scale": s.view(torch.float8_e8m0fnu)}
        if name.endswith("engram.embed.weight"):
            q, s = formats.encode_window_fp8(t.float())  # per-row UE8M0 per 32 (engram.md §5)
            return {name: q.view(torch.float8_e4m3fn), name[:-len("weight")] + "scale": s.view(torch.float8_e8m0fnu)}
    return {name: t.to(torch.bfloat16).contiguous()}


def save_checkpoint(model: Transformer, path: str | Path, *, dtype: str = "fp32",
                    tokenizer_json: str | Path | None = None, max_shard_bytes: int = 4 << 30) -> Path:
    """Write config.json + safetensors (sharded with an index above max_shard_bytes), atomically per file.

    dtype "fp32" keeps trained weights exactly (training checkpoints), "bf16" halves them, "fp8" quantizes to the
    official released layout (loadable by the reference code and by engines that read the official checkpoint).
    """
    if dtype not in ("fp32", "bf16", "fp8"):
        raise ValueError(f"checkpoint dtype must be fp32, bf16 or fp8, got {dtype!r}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensors.update(official_tensors(name, tensor, dtype))
    cfg = model.cfg
    if dtype == "fp8":
        cfg = cfg.replace(weight_dtype="fp8", expert_dtype="fp4")
    elif cfg.weight_dtype != "fp8":
        cfg = cfg.replace(weight_dtype=dtype, expert_dtype=dtype)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in list(folder.glob("model*.safetensors")) + [folder / INDEX_FILE]:
        if stale.exists():
            stale.unlink()
    if len(shards) == 1:
        _atomic_save(shards[0], folder / SINGLE_FILE)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            _atomic_save(shard, folder / name)
            for key, t in shard.items():
                weight_map[key] = name
                total += t.numel() * t.element_size()
        write_text_atomic(folder / INDEX_FILE, json.dumps({"metadata": {"total_size": total},
                                                            "weight_map": weight_map}, indent=1))
    write_text_atomic(folder / "config.json", json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    if tokenizer_json is not None:
        write_text_atomic(folder / "tokenizer.json", Path(tokenizer_json).read_text())
    write_manifest(folder)
    return folder


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def count_by_dtype(folder: str | Path) -> dict[str, int]:
    """Tensor counts per stored dtype (for reports and tests)."""
    files = _TensorFiles(Path(folder))
    counts: dict[str, int] = defaultdict(int)
    for name in files.names():
        counts[files.info(name)[0]] += 1
    return dict(counts)
