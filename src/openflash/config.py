"""Model configuration, presets and the derived CSA2 / CED topology.

`FlashConfig` holds the text model's hyper-parameters under the official Hugging Face `text_config` key names
(spec: architecture.md §1). It loads the official nested HF `config.json` and the reference's flat
`inference/config.json` (its names: reference_names.py), and saves back in the HF form; keys it does not model
(vision_config, tokens, quantization details, unknown keys) are kept and round-tripped. Every config is validated
when built (`validate`, config_rules.py).

The per-layer topology (mode, owners, RoPE kind, Engram placement, encoder/decoder half) is derived once, in
`FlashConfig.topology` (topology.py), and every other module reads it from there.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from openflash.config_parts import DSparkConfig, VisionConfig
from openflash.config_rules import validate
from openflash.errors import ConfigError
from openflash.reference_names import adopt_reference_names, reference_layout
from openflash.topology import Topology, build_topology

log = logging.getLogger("openflash.config")

PRESETS = ("flash", "tiny", "small", "tiny-vl")

# HF `dtype` spellings of unquantized checkpoints -> our storage names.
_STORAGE_DTYPE_NAMES = {"bfloat16": "bf16", "float32": "fp32", "bf16": "bf16", "fp32": "fp32"}


@dataclass
class FlashConfig:
    """The text model's hyper-parameters (HF `text_config` names) plus round-tripped extras."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    swiglu_limit: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    sliding_window: int
    compress_ratios: list[int]
    kv_source_layer_ids: list[int]
    index_source_layer_ids: list[int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: list[int]
    engram_num_embeddings: list[int]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int = 0
    norm_topk_prob: bool = True
    gate_temp: float = 1.0  # not in config.json; the reference default (scores are divided by it)
    num_key_value_heads: int = 1
    image_token_id: int | None = None
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    # Storage formats of the weights: "fp8" dense linears with 32x32 UE8M0 blocks and "fp4" routed experts, as
    # released; "bf16"/"fp32" for models trained here (quantized only when saved with quantization).
    weight_dtype: str = "fp8"
    expert_dtype: str = "fp4"
    # Keys of config.json that are not modelled here (dspark_*, vision_config, unknown keys): kept verbatim.
    extra_text: dict[str, Any] = field(default_factory=dict)
    extra_root: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)

    # ---- derived facts, computed once ---------------------------------------------------------------------
    @cached_property
    def topology(self) -> Topology:
        return build_topology(self)

    @property
    def n_hash_columns(self) -> int:
        """Engram rows fetched per token per layer: (max_ngram - 1) * heads (engram.md)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def has_vision(self) -> bool:
        """A vision tower exists (vision_config.num_hidden_layers > 0): the router then has `bias_vl`."""
        vision = self.extra_root.get("vision_config") or {}
        return bool(vision.get("num_hidden_layers", 0))

    @cached_property
    def vision(self) -> VisionConfig | None:
        """The vision tower's shape, or None without one (no vision_config, or num_hidden_layers 0)."""
        if not self.has_vision:
            return None
        raw = self.extra_root["vision_config"]
        if not isinstance(raw, dict):
            raise ConfigError(f"vision_config must be an object, got {raw!r}")
        if self.image_token_id is None:
            raise ConfigError("vision_config has layers but the config has no image_token_id (the input id of "
                              "every image-span position)")
        return VisionConfig.from_dict(raw)

    @cached_property
    def dspark(self) -> DSparkConfig | None:
        """The draft head's shape, or None without one (num_nextn_predict_layers 0)."""
        if self.num_nextn_predict_layers == 0:
            return None
        extra = self.extra_text
        need = ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
                "dspark_n_routed_experts", "dspark_num_experts_per_tok")
        missing = [k for k in need if k not in extra]
        if missing:
            raise ConfigError(f"num_nextn_predict_layers = {self.num_nextn_predict_layers} (DSpark stages) but the "
                              f"config lacks {missing}")
        return DSparkConfig(self.num_nextn_predict_layers, int(extra["dspark_block_size"]),
                            int(extra["dspark_noise_token_id"]),
                            tuple(int(i) for i in extra["dspark_target_layer_ids"]), int(extra["dspark_markov_rank"]),
                            int(extra["dspark_n_routed_experts"]), int(extra["dspark_num_experts_per_tok"]))

    @property
    def dspark_bounded_ok(self) -> bool:
        """Bounded prefill (architecture.md §7.3) can feed the drafter: every target layer is in the CED decoder
        half, which runs on the replayed tail (encoder-half streams are not kept for it)."""
        d, split = self.dspark, self.topology.decoder_start
        return d is not None and (split >= self.num_hidden_layers or min(d.target_layer_ids) >= split)

    def dspark_stage_config(self) -> "FlashConfig":
        """The config a draft stage's MoE is built from: the backbone's, with the stage expert count and top-k."""
        d = self.dspark
        return self.replace(n_routed_experts=d.n_routed_experts, num_experts_per_tok=d.num_experts_per_tok)

    def with_dspark(self, stages: int = 3, block_size: int = 5, noise_token_id: int | None = None,
                    target_layer_ids: list[int] | None = None, markov_rank: int = 32,
                    n_routed_experts: int | None = None, num_experts_per_tok: int | None = None) -> "FlashConfig":
        """This config with a DSpark draft head added (defaults: the released rules at this model's size: the
        last three layers as targets, the backbone's expert count, top-3, the pad token as noise: like the
        release's placeholder id, it never occurs in text)."""
        n = self.num_hidden_layers
        extra = dict(self.extra_text)
        extra.update(dspark_block_size=block_size,
                     dspark_noise_token_id=self.pad_token_id if noise_token_id is None else noise_token_id,
                     dspark_target_layer_ids=list(target_layer_ids or range(max(0, n - 3), n)),
                     dspark_markov_rank=markov_rank,
                     dspark_n_routed_experts=n_routed_experts or self.n_routed_experts,
                     dspark_num_experts_per_tok=num_experts_per_tok or min(3, n_routed_experts or
                                                                           self.n_routed_experts))
        return self.replace(num_nextn_predict_layers=stages, compress_ratios=self.backbone_ratios + [0] * stages,
                            extra_text=extra)

    @property
    def backbone_ratios(self) -> list[int]:
        return self.compress_ratios[: self.num_hidden_layers]

    # ---- (de)serialisation -------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], source: str = "config") -> "FlashConfig":
        """Build from the official nested HF config.json (or a flat dict of text_config keys)."""
        data = copy.deepcopy(data)
        if "text_config" in data:
            text = data.pop("text_config")
            root = data
        else:
            text, root = data, {}
        if isinstance(text, dict):
            text = adopt_reference_names(text, source)
        return cls._from_text_and_root(text, root, source)

    @classmethod
    def from_reference_dict(cls, data: dict[str, Any], source: str = "config") -> "FlashConfig":
        """Build from the reference's flat inference/config.json (ModelArgs field names)."""
        text, root = reference_layout(data)
        return cls._from_text_and_root(text, root, source)

    @classmethod
    def _from_text_and_root(cls, text: dict[str, Any], root: dict[str, Any], source: str) -> "FlashConfig":
        text = dict(text)
        rope = text.pop("rope_scaling", None) or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: text_config.rope_scaling must be an object, got {rope!r}")
        for hf_key, field_name in (("factor", "rope_factor"), ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow"),
                                   ("original_max_position_embeddings", "original_max_position_embeddings")):
            if hf_key in rope:
                text[field_name] = rope[hf_key]
        extra_rope = {k: v for k, v in rope.items()
                      if k not in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")}
        quant = root.get("quantization_config") or {}
        kwargs: dict[str, Any] = {}
        fields = {f.name: f for f in dataclasses.fields(cls)}
        extra_text: dict[str, Any] = {}
        for key, value in text.items():
            if key in fields and key not in ("extra_text", "extra_root", "weight_dtype", "expert_dtype",
                                             "image_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
                kwargs[key] = value
            else:
                extra_text[key] = value
        if extra_rope:
            extra_text["rope_scaling_extra"] = extra_rope
        for key in ("image_token_id", "bos_token_id", "eos_token_id", "pad_token_id"):
            if key in root:
                kwargs[key] = root[key]
        if quant:
            kwargs["weight_dtype"] = quant.get("quant_method", "fp8")
            kwargs["expert_dtype"] = quant.get("expert_dtype", kwargs["weight_dtype"])
        elif "torch_dtype" in root or "dtype" in root:
            name = root.get("dtype", root.get("torch_dtype"))
            kwargs["weight_dtype"] = kwargs["expert_dtype"] = _STORAGE_DTYPE_NAMES.get(name, name)
        kwargs["extra_text"] = extra_text
        kwargs["extra_root"] = {k: v for k, v in root.items()
                                if k not in ("image_token_id", "bos_token_id", "eos_token_id", "pad_token_id")}
        required = [f.name for f in fields.values()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in kwargs]
        if missing:
            raise ConfigError(f"{source}: missing text_config key(s): {', '.join(missing)}")
        for name, value in kwargs.items():
            _check_type(source, name, value, fields[name].type)
        try:
            return cls(**kwargs)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The official nested HF layout; unknown keys come back where they were."""
        text: dict[str, Any] = {}
        skip = {"extra_text", "extra_root", "weight_dtype", "expert_dtype", "rope_factor", "beta_fast", "beta_slow",
                "original_max_position_embeddings", "gate_temp", "image_token_id", "bos_token_id", "eos_token_id",
                "pad_token_id"}
        for f in dataclasses.fields(self):
            if f.name not in skip:
                text[f.name] = copy.deepcopy(getattr(self, f.name))
        if self.gate_temp != 1.0:
            text["gate_temp"] = self.gate_temp
        extra_text = dict(self.extra_text)
        rope_extra = extra_text.pop("rope_scaling_extra", {"rope_type": "yarn"})
        text["rope_scaling"] = {**rope_extra, "factor": self.rope_factor, "beta_fast": self.beta_fast,
                                "beta_slow": self.beta_slow,
                                "original_max_position_embeddings": self.original_max_position_embeddings}
        text.update(extra_text)
        root = copy.deepcopy(self.extra_root)
        root.setdefault("architectures", ["DeepseekV41ForCausalLM"])
        root.setdefault("model_type", "deepseek_v41")
        root["bos_token_id"], root["eos_token_id"], root["pad_token_id"] = (
            self.bos_token_id, self.eos_token_id, self.pad_token_id)
        if self.image_token_id is not None:
            root["image_token_id"] = self.image_token_id
        if self.weight_dtype in ("fp8",):
            quant = root.setdefault("quantization_config", {})
            quant.setdefault("quant_method", "fp8")
            quant.setdefault("activation_scheme", "dynamic")
            quant.setdefault("weight_block_size", [32, 32])
            quant.setdefault("scale_fmt", "ue8m0")
            quant["expert_dtype"] = self.expert_dtype
        else:
            root.pop("quantization_config", None)
            root["dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[self.weight_dtype]
        root["text_config"] = text
        return root

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "FlashConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# ---- loading -------------------------------------------------------------------------------------------------

def load_config(name_or_path: str | Path) -> FlashConfig:
    """A preset name (flash, tiny, small), a config.json path, or a checkpoint folder holding config.json.

    Both the HF nested layout and the reference's flat layout are accepted (told apart by their keys).
    """
    text = str(name_or_path)
    if text in PRESETS:
        raw = resources.files("openflash.presets").joinpath(f"{text}.json").read_text()
        return FlashConfig.from_hf_dict(json.loads(raw), source=f"preset '{text}'")
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise ConfigError(f"{text}: no such preset or config file (presets: {', '.join(PRESETS)})")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: config must be a JSON object")
    if "text_config" in data or "hidden_size" in data:
        return FlashConfig.from_hf_dict(data, source=str(path))
    if "dim" in data:
        return FlashConfig.from_reference_dict(data, source=str(path))
    raise ConfigError(f"{path}: neither an HF config (text_config / hidden_size) nor a reference config (dim)")


def _check_type(source: str, name: str, value: Any, annotation: Any) -> None:
    kind = str(annotation)
    if kind.startswith("list"):
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        expect = "a list of integers"
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        expect = "an integer"
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        expect = "a number"
    elif kind == "bool":
        ok = isinstance(value, bool)
        expect = "true or false"
    elif kind == "str":
        ok = isinstance(value, str)
        expect = "a string"
    else:
        return
    if not ok:
        raise ConfigError(f"{source}: {name} must be {expect}, got {value!r}")


__all__ = ["FlashConfig", "load_config", "validate", "PRESETS"]
