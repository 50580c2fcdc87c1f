"""Token ids -> Engram hash ids: the token map plus the n-gram hasher, with the per-sequence history.

Hash ids depend on token ids alone, so whoever knows the tokens first (the engine, right after sampling; the
trainer, for the next batch) can compute them and start fetching rows before the model needs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from openflash.config import FlashConfig
from openflash.memory.hashing import EngramHashLayout, EngramHashState, NgramHasher, compress
from openflash.memory.tokenmap import TokenMap
from openflash.tokenizer import DEEPSEEK, load_tokenizer


@dataclass
class EngramFrontend:
    token_map: TokenMap
    layout: EngramHashLayout
    hasher: NgramHasher

    @classmethod
    def for_config(cls, cfg: FlashConfig, tokenizer: Tokenizer | None = None) -> "EngramFrontend":
        """Build from the model's tokenizer (default: the DeepSeek tokenizer, restricted to vocab_size ids)."""
        tok = tokenizer if tokenizer is not None else load_tokenizer(DEEPSEEK)
        token_map = TokenMap.for_config(tok, cfg)
        layout = EngramHashLayout.from_config(cfg, token_map)
        return cls(token_map, layout, NgramHasher(layout))

    @classmethod
    def from_token_map(cls, cfg: FlashConfig, token_map: TokenMap) -> "EngramFrontend":
        """Build from a token map the checkpoint carries (TokenMap.from_file)."""
        layout = EngramHashLayout.from_config(cfg, token_map)
        return cls(token_map, layout, NgramHasher(layout))

    @classmethod
    def of(cls, cfg: FlashConfig, tokenizer: Tokenizer | None = None,
           token_map: TokenMap | None = None) -> "EngramFrontend | None":
        """The frontend of a model: from the token map it carries if any, else from its tokenizer (default the
        DeepSeek tokenizer); None for a model without Engram layers."""
        if not cfg.engram_layer_ids:
            return None
        return cls.from_token_map(cfg, token_map) if token_map is not None else cls.for_config(cfg, tokenizer)

    def hash(self, input_ids: torch.Tensor, state: EngramHashState, token_mask: torch.Tensor | None = None,
             lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, EngramHashState]:
        """Hash ids [B, S, n_engram_layers, C] of a chunk following `state`, and the state after it (lengths:
        right-padded rows, NgramHasher.hash)."""
        return self.hasher.hash(compress(input_ids, self.token_map, token_mask), state, lengths)
