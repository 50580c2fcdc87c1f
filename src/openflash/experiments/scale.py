"""How big a study runs: model width, token budget, seeds, data. One `Scale` serves every study, so every arm of
every study trains the same way (same data, steps, batch, learning rate and schedule)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from openflash.errors import OpenflashError


@dataclass(frozen=True)
class Scale:
    name: str
    preset: str  # the base the study configs are derived from (arms.py)
    hidden_size: int
    moe_intermediate_size: int
    n_routed_experts: int  # of the pure-MoE reference; Engram arms trade experts for table rows
    steps: int
    batch_size: int
    seq_len: int
    seeds: int
    lr: float
    warmup: int
    eval_batches: int  # validation batches of batch_size x seq_len tokens, the same windows for every run
    corpus_bytes: int  # Python stdlib source
    tokenizer_bytes: int
    vocab_size: int
    probe_windows: int  # validation windows the analysis studies (depth-probe, reuse, replay) read
    replay_lengths: tuple[int, ...]  # prompt lengths of the replay study
    offload_table_mib: int  # Engram table bytes of the offload study's model
    offload_rounds: int
    offload_tokens: int  # decode tokens per offload round

    @property
    def tokens_per_run(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    def as_dict(self) -> dict:
        out = asdict(self)
        out["tokens_per_run"] = self.tokens_per_run
        return out


SCALES: dict[str, Scale] = {
    # What the README and docs/experiments.md report: all six studies in about an hour on 2 cores (--jobs 2).
    "cpu": Scale("cpu", preset="tiny", hidden_size=128, moe_intermediate_size=96, n_routed_experts=16, steps=600,
                 batch_size=8, seq_len=128, seeds=3, lr=3e-3, warmup=30, eval_batches=32, corpus_bytes=4_000_000,
                 tokenizer_bytes=2_000_000, vocab_size=2048, probe_windows=32,
                 replay_lengths=(32, 64, 128, 256, 512), offload_table_mib=512, offload_rounds=24,
                 offload_tokens=32),
    # A real machine (torchrun data parallel over --nproc-per-node): 4x wider experts, 8x the tokens.
    "large": Scale("large", preset="small", hidden_size=256, moe_intermediate_size=256, n_routed_experts=32,
                   steps=4000, batch_size=32, seq_len=256, seeds=3, lr=2e-3, warmup=100, eval_batches=64,
                   corpus_bytes=40_000_000, tokenizer_bytes=6_000_000, vocab_size=4096, probe_windows=64,
                   replay_lengths=(64, 128, 256, 512, 1024, 2048), offload_table_mib=8192, offload_rounds=12,
                   offload_tokens=64),
    # The test suite's: every study end to end in seconds (the numbers mean nothing).
    "test": Scale("test", preset="tiny", hidden_size=128, moe_intermediate_size=64, n_routed_experts=8, steps=6,
                  batch_size=2, seq_len=32, seeds=2, lr=3e-3, warmup=2, eval_batches=2, corpus_bytes=60_000,
                  tokenizer_bytes=60_000, vocab_size=512, probe_windows=2, replay_lengths=(20, 40),
                  offload_table_mib=2, offload_rounds=2, offload_tokens=3),
}


def get_scale(name: str) -> Scale:
    if name not in SCALES:
        raise OpenflashError(f"unknown --scale {name!r}; choose one of {list(SCALES)}")
    return SCALES[name]
