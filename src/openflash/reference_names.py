"""The reference's names for config keys (its flat inference/config.json, ModelArgs field names) and the official
HF names they stand for (spec: architecture.md §1), for configs written either way: pure functions on the JSON."""

from __future__ import annotations

import logging
from typing import Any

from openflash.errors import ConfigError

log = logging.getLogger("openflash.config")

# Reference flat key (inference/config.json) -> HF text_config key, where they differ (spec: architecture.md §1).
REFERENCE_TO_HF = {
    "dim": "hidden_size",
    "moe_inter_dim": "moe_intermediate_size",
    "n_layers": "num_hidden_layers",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_heads": "num_attention_heads",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "rope_head_dim": "qk_rope_head_dim",
    "norm_eps": "rms_norm_eps",
    "window_size": "sliding_window",
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_id": "engram_pad_token_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
}
# Reference keys that live in HF `rope_scaling`.
REFERENCE_ROPE_SCALING = {
    "rope_factor": "factor",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
    "original_seq_len": "original_max_position_embeddings",
}
# Reference runtime fields that are not part of the model.
REFERENCE_RUNTIME = {"max_batch_size", "max_seq_len", "temperature"}


def adopt_reference_names(text: dict[str, Any], source: str) -> dict[str, Any]:
    """A text_config that uses the reference's short names (norm_eps, rope_head_dim, score_func, route_scale,
    original_seq_len, ...) where the HF name is absent, as some writers do: take them under their HF names. A key
    given both ways must agree."""
    text = dict(text)
    rope = dict(text.get("rope_scaling") or {}) if isinstance(text.get("rope_scaling"), dict) else None
    adopted = []
    for short, hf in [*REFERENCE_TO_HF.items(), *REFERENCE_ROPE_SCALING.items()]:
        if short not in text:
            continue
        target = rope if short in REFERENCE_ROPE_SCALING else text
        if target is None:
            target = rope = {}
        value = text.pop(short)
        if hf in target and target[hf] != value:
            raise ConfigError(f"{source}: text_config gives {short}={value!r} (the reference's name) and "
                              f"{hf}={target[hf]!r}; they must agree")
        target.setdefault(hf, value)
        adopted.append(f"{short} -> {hf}")
    if rope is not None and (rope or "rope_scaling" in text):
        text["rope_scaling"] = rope
    if adopted:
        log.info("%s: text_config uses reference key names; read as %s", source, ", ".join(adopted))
    return text


def reference_layout(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A flat reference config as the HF layout's (text_config, root) dicts."""
    text: dict[str, Any] = {}
    rope_scaling: dict[str, Any] = {"rope_type": "yarn"}
    root: dict[str, Any] = {}
    for key, value in data.items():
        if key in REFERENCE_RUNTIME:
            continue
        if key in REFERENCE_ROPE_SCALING:
            rope_scaling[REFERENCE_ROPE_SCALING[key]] = value
        elif key == "dtype":
            root.setdefault("quantization_config", {})["quant_method"] = value
        elif key == "expert_dtype":
            root.setdefault("quantization_config", {})["expert_dtype"] = value
        elif key == "image_token_id":
            root[key] = value
        elif key.startswith("vision_"):
            root.setdefault("vision_config", {})[key[len("vision_"):]] = value
        else:
            text[REFERENCE_TO_HF.get(key, key)] = value
    text["rope_scaling"] = rope_scaling
    return text, root


__all__ = ["REFERENCE_TO_HF", "REFERENCE_ROPE_SCALING", "REFERENCE_RUNTIME", "adopt_reference_names",
           "reference_layout"]
