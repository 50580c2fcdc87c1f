"""The consistency rules of a model configuration (`validate`, run whenever a FlashConfig is built): each failure
a ConfigError naming the key and value at fault, so a wrong config.json is refused before any weight is read."""

from __future__ import annotations

from typing import Any

from openflash.errors import ConfigError


def validate(cfg: Any) -> None:
    """Raise ConfigError naming the key and value of the first inconsistency of `cfg`, a FlashConfig being built
    (typed loosely: config.py calls this, so importing its class here would make a circle)."""
    n = cfg.num_hidden_layers

    def fail(message: str) -> None:
        raise ConfigError(message)

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                 "q_lora_rank", "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts",
                 "num_experts_per_tok", "sliding_window", "hc_mult", "hc_sinkhorn_iters"):
        if getattr(cfg, name) < 1:
            fail(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.num_nextn_predict_layers < 0:
        fail(f"num_nextn_predict_layers must be >= 0, got {cfg.num_nextn_predict_layers}")
    if len(cfg.compress_ratios) not in (n, n + cfg.num_nextn_predict_layers):
        fail(f"compress_ratios has {len(cfg.compress_ratios)} entries; expected num_hidden_layers "
             f"({n}) + num_nextn_predict_layers ({cfg.num_nextn_predict_layers})")
    for i, r in enumerate(cfg.compress_ratios):
        if r < 0:
            fail(f"compress_ratios[{i}] must be >= 0, got {r}")
    for i in range(n, len(cfg.compress_ratios)):
        if cfg.compress_ratios[i] != 0:
            fail(f"compress_ratios[{i}] = {cfg.compress_ratios[i]}: DSpark stages must be window-only (ratio 0)")
    if cfg.num_nextn_predict_layers:
        d = cfg.dspark
        if d.block_size < 2:
            fail(f"dspark_block_size must be >= 2, got {d.block_size}")
        if not 0 <= d.noise_token_id < cfg.vocab_size:
            fail(f"dspark_noise_token_id {d.noise_token_id} is outside the vocabulary (0..{cfg.vocab_size - 1})")
        if not d.target_layer_ids or any(not 0 <= i < n for i in d.target_layer_ids):
            fail(f"dspark_target_layer_ids must be backbone layers 0..{n - 1}, got {list(d.target_layer_ids)}")
        if d.markov_rank < 1 or not 1 <= d.num_experts_per_tok <= d.n_routed_experts:
            fail(f"dspark_markov_rank ({d.markov_rank}) must be >= 1 and dspark_num_experts_per_tok "
                 f"({d.num_experts_per_tok}) in 1..dspark_n_routed_experts ({d.n_routed_experts})")
    if cfg.num_attention_heads % cfg.o_groups:
        fail(f"num_attention_heads ({cfg.num_attention_heads}) is not divisible by o_groups ({cfg.o_groups})")
    if cfg.num_key_value_heads != 1:
        fail(f"num_key_value_heads must be 1 (one shared K=V latent), got {cfg.num_key_value_heads}")
    if cfg.qk_rope_head_dim % 2 or not 0 < cfg.qk_rope_head_dim <= cfg.head_dim:
        fail(f"qk_rope_head_dim must be even and in (0, head_dim={cfg.head_dim}], got {cfg.qk_rope_head_dim}")
    if cfg.qk_rope_head_dim > cfg.index_head_dim:
        fail(f"qk_rope_head_dim ({cfg.qk_rope_head_dim}) exceeds index_head_dim ({cfg.index_head_dim})")
    # Cache quantizers work in blocks of 32 (FP8 / MXFP4) and 16 (FP4 main KV): quant_and_cache.md §2.
    for name in ("head_dim", "index_head_dim", "engram_head_dim", "hidden_size"):
        if getattr(cfg, name) % 32:
            fail(f"{name} must be a multiple of 32 (quantization block), got {getattr(cfg, name)}")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        fail(f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds n_routed_experts ({cfg.n_routed_experts})")
    if cfg.scoring_func != "sqrtsoftplus":
        fail(f"scoring_func {cfg.scoring_func!r} is not supported (V4.1 uses 'sqrtsoftplus')")
    if cfg.rope_factor <= 0 or cfg.original_max_position_embeddings < 1:
        fail(f"rope_scaling factor/original_max_position_embeddings must be positive, got "
             f"{cfg.rope_factor}/{cfg.original_max_position_embeddings}")

    ratios = cfg.compress_ratios
    kv, idx = cfg.kv_source_layer_ids, cfg.index_source_layer_ids
    for key, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx)):
        if ids != sorted(set(ids)):
            fail(f"{key} must be strictly increasing, got {ids}")
        for layer in ids:
            if not 0 <= layer < n:
                fail(f"{key} names layer {layer}, which does not exist (num_hidden_layers = {n})")
            if ratios[layer] == 0:
                fail(f"{key} names layer {layer}, whose compress_ratio is 0 (window-only layers own no KV)")
    missing = [layer for layer in kv if layer not in idx]
    if missing:
        fail(f"kv_source_layer_ids {missing} are not in index_source_layer_ids {idx} (every KV source indexes)")
    last_kv: int | None = None
    for layer in range(n):
        if layer in kv:
            last_kv = layer
        if ratios[layer] > 0:
            if last_kv is None:
                fail(f"layer {layer} has compress_ratio {ratios[layer]} but no KV source at or before it "
                     f"(kv_source_layer_ids = {kv})")
            if ratios[last_kv] != ratios[layer]:
                fail(f"layer {layer} has compress_ratio {ratios[layer]} but its KV owner, layer {last_kv}, has "
                     f"ratio {ratios[last_kv]}")
    if cfg.index_topk < 1:
        fail(f"index_topk must be >= 1, got {cfg.index_topk}")
    cand = cfg.candidate_source_layer_id
    if cand >= 0:
        if cand not in idx:
            fail(f"candidate_source_layer_id {cand} is not an index source (index_source_layer_ids = {idx})")
        if cfg.candidate_topk_blocks < 1 or cfg.candidate_block_size < 1:
            fail(f"candidate_topk_blocks and candidate_block_size must be >= 1 with a candidate source, got "
                 f"{cfg.candidate_topk_blocks} and {cfg.candidate_block_size}")
        if cfg.candidate_topk_blocks * cfg.candidate_block_size < cfg.index_topk:
            fail(f"candidate pool candidate_topk_blocks*candidate_block_size = "
                 f"{cfg.candidate_topk_blocks}*{cfg.candidate_block_size} is smaller than index_topk "
                 f"({cfg.index_topk})")
    elif cand != -1:
        fail(f"candidate_source_layer_id must be a layer index or -1 (no candidate pool), got {cand}")

    eng = cfg.engram_layer_ids
    if eng:
        if eng != sorted(set(eng)):
            fail(f"engram_layer_ids must be strictly increasing, got {eng}")
        if len(cfg.engram_num_embeddings) != len(eng):
            fail(f"engram_num_embeddings has {len(cfg.engram_num_embeddings)} entries for "
                 f"{len(eng)} engram_layer_ids")
        for layer in eng:
            if not 0 <= layer < n:
                fail(f"engram_layer_ids names layer {layer}, which does not exist (num_hidden_layers = {n})")
        if cfg.engram_max_ngram_size < 2:
            fail(f"engram_max_ngram_size must be >= 2, got {cfg.engram_max_ngram_size}")
        if cfg.engram_n_heads < 1 or cfg.engram_vocab_size < 2 or cfg.engram_compressed_vocab_size < 1:
            fail("engram_n_heads, engram_vocab_size and engram_compressed_vocab_size must be positive")
        if not 0 <= cfg.engram_pad_token_id < cfg.vocab_size:
            fail(f"engram_pad_token_id {cfg.engram_pad_token_id} is outside the vocabulary ({cfg.vocab_size})")
    if cfg.image_token_id is not None and not 0 <= cfg.image_token_id < cfg.vocab_size:
        fail(f"image_token_id {cfg.image_token_id} is outside the vocabulary ({cfg.vocab_size})")
    if cfg.has_vision:
        cfg.vision  # noqa: B018 (parses and validates vision_config now, with its own message)
    if cfg.weight_dtype not in ("fp8", "bf16", "fp32"):
        fail(f"quantization_config.quant_method / dtype {cfg.weight_dtype!r} is not one of fp8, bf16, fp32")
    if cfg.expert_dtype not in ("fp4", "fp8", "bf16", "fp32"):
        fail(f"quantization_config.expert_dtype {cfg.expert_dtype!r} is not one of fp4, fp8, bf16, fp32")


__all__ = ["validate"]
