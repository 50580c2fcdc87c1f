"""Held-out perplexity of a prepared data folder (`openflash eval --perplexity DATA_DIR`): every document of its
validation split scored whole, in lm-eval's disjoint rolling windows (each token predicted once, with as much
context as `max_length` holds), through the same engine path as lm-eval's log-likelihoods (evaluation/harness.py).
"""

from __future__ import annotations

import math
from typing import Any

from openflash.errors import OpenflashError
from openflash.tokenizer import tokenizer_sha256
from openflash.train.dataset import TokenDataset


def held_out_perplexity(lm: Any, data_dir: str, limit: int | None = None) -> dict[str, Any]:
    """exp(mean negative log-likelihood a token) over the validation split's documents (the first `limit`); each
    document's first token is its context (a prepared document starts with BOS), the rest are predicted."""
    data = TokenDataset(data_dir, "val")
    if data.loss_mask:
        raise OpenflashError(f"{data_dir} is chat data (a loss mask on the replies): its perplexity would mix "
                             f"prompts and replies; prepare plain text for --perplexity")
    if tokenizer_sha256(lm.tokenizer) != data.tokenizer_sha256:
        raise OpenflashError(f"{data_dir} was prepared with another tokenizer than the model's: prepare it with the "
                             f"model's tokenizer")
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    count = data.num_docs if limit is None else min(limit, data.num_docs)
    windows = []
    for i in range(count):
        start, end = int(data.doc_offsets[i]), int(data.doc_offsets[i + 1])
        if end - start < 2:
            continue
        doc = data.read(start, end - start).tolist()
        windows += map(make_disjoint_window, get_rolling_token_windows(
            token_list=doc[1:], prefix_token=doc[0], max_seq_len=lm.max_length, context_len=1))
    if not windows:
        raise OpenflashError(f"{data_dir}: the validation split has no document of two tokens or more (prepare "
                             f"the folder with a larger --val-fraction)")
    scored = lm.score(windows)
    tokens = sum(len(pred) for _, pred in windows)
    nll = -sum(logprob for logprob, _ in scored) / tokens
    return {"data": str(data_dir), "split": "val", "documents": count, "tokens": tokens, "nll_per_token": nll,
            "perplexity": math.exp(nll), "bits_per_token": nll / math.log(2)}


__all__ = ["held_out_perplexity"]
