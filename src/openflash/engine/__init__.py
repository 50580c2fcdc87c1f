"""Inference engine.

    sampling.py      per-request samplers, stop conditions
    generate.py      single-request generation (the sequential baseline) and `openflash generate`
    request.py       a request's sequence state, statuses, finish reasons, outputs, timestamps
    scheduler.py     continuous batching: waiting / prefilling / running, chunked prefill within a token budget
    runner.py        model calls: per-sequence prefill, batched decode on a regrouped batch cache
    cache.py         block pool for the global compressed KV, packed storage formats, batch regrouping
    prefix_cache.py  prompt-prefix states keyed by token-block hashes, LRU, persistence
    metrics.py       latency histograms and counters
    config.py        EngineConfig (validated) and the persisted prefix cache's model fingerprint
    engine.py        LLMEngine: add_request / abort / step / background loop
"""
