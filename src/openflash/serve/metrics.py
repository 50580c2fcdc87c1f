"""GET /metrics: the engine's state and measurements in the Prometheus text exposition format (version 0.0.4).

Latencies are histograms (seconds): time to first token, inter-token latency, end-to-end request latency, queue
time, engine step time. Gauges: waiting / prefilling / running sequences, KV blocks in use and allocated, global
cache bytes per token, prefix-cache and Engram row-cache hit rates (the Engram one only with a tier that has a row
cache, e.g. disk), expert-cache hits, misses and bytes read per layer (with --expert-placement host or disk),
generated tokens per second over the last 10 s. Counters: prompt tokens computed and served from the prefix cache,
generated tokens, finished requests by reason, engine steps, and on the compiled backend the decode steps run as
one graph, the graphs compiled and the seconds spent compiling them.
"""

from __future__ import annotations

from openflash.engine.engine import LLMEngine
from openflash.engine.metrics import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "openflash"


def _fmt(value: float) -> str:
    if value != value:  # NaN
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str, value: float, labels: str = "") -> None:
        full = f"{PREFIX}_{name}"
        self.lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full}{labels} {_fmt(value)}"]

    def labelled(self, name: str, kind: str, help_text: str, values: dict[str, float], label: str) -> None:
        full = f"{PREFIX}_{name}"
        self.lines += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
        for key, value in sorted(values.items()):
            self.lines.append(f'{full}{{{label}="{key}"}} {_fmt(value)}')

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        full = f"{PREFIX}_{name}"
        cumulative, total, count = hist.snapshot()
        self.lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
        for bound, c in zip(hist.buckets, cumulative):
            self.lines.append(f'{full}_bucket{{le="{bound}"}} {c}')
        self.lines.append(f'{full}_bucket{{le="+Inf"}} {cumulative[-1]}')
        self.lines += [f"{full}_sum {_fmt(total)}", f"{full}_count {count}"]

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render(engine: LLMEngine) -> str:
    m, stats = engine.metrics, engine.stats()
    w = _Writer()
    w.histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.", m.ttft)
    w.histogram("inter_token_latency_seconds", "Time between consecutive tokens of a request.", m.itl)
    w.histogram("e2e_request_latency_seconds", "Time from arrival to the end of a request.", m.e2e)
    w.histogram("queue_time_seconds", "Time from arrival to admission.", m.queue_time)
    w.histogram("engine_step_seconds", "Duration of one engine step.", m.step_time)
    w.metric("num_requests_waiting", "gauge", "Requests waiting to be admitted.", stats["waiting"])
    w.metric("num_requests_prefilling", "gauge", "Requests whose prompt is being prefilled.", stats["prefilling"])
    w.metric("num_requests_running", "gauge", "Sequences in the decode batch.", stats["running"])
    w.metric("kv_blocks_in_use", "gauge", "Global-cache blocks referenced (sequences and prefix cache).",
             stats["kv_blocks_in_use"])
    w.metric("kv_blocks_allocated", "gauge", "Global-cache blocks allocated in the pool.", stats["kv_blocks_total"])
    w.metric("kv_cache_bytes_per_token", "gauge", "Global compressed-cache bytes per token (all KV-owner layers).",
             stats["global_cache_bytes_per_token"])
    pc = stats["prefix_cache"]
    if pc is not None:
        w.metric("prefix_cache_hit_rate", "gauge", "Fraction of prompts that reused a cached prefix.", pc["hit_rate"])
        w.metric("prefix_cache_token_hit_rate", "gauge", "Fraction of prompt tokens served from the prefix cache.",
                 pc["token_hit_rate"])
        w.metric("prefix_cache_entries", "gauge", "Cached prefixes.", pc["entries"])
        w.metric("prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", pc["bytes"])
    engram = stats["engram"]
    if engram is not None and engram.get("hit_rate") is not None:
        w.metric("engram_cache_hit_rate", "gauge", "Engram row-cache hit rate.", engram["hit_rate"])
    experts = stats["experts"]
    if experts is not None:
        layers = experts["layers"]
        w.labelled("expert_cache_hits_total", "counter", "Routed experts found in the expert cache, by layer.",
                   {str(i): c["hits"] for i, c in layers.items()}, "layer")
        w.labelled("expert_cache_misses_total", "counter", "Routed experts fetched from host or disk, by layer.",
                   {str(i): c["misses"] for i, c in layers.items()}, "layer")
        w.labelled("expert_bytes_read_total", "counter", "Bytes of routed experts read (disk, or host to device).",
                   {str(i): c["bytes_read"] for i, c in layers.items()}, "layer")
        w.labelled("expert_prefetched_total", "counter", "Expert-cache misses a prefetch read had already started.",
                   {str(i): c["prefetched"] for i, c in layers.items()}, "layer")
        w.labelled("expert_prefetch_reads_total", "counter", "Routed experts read on a router's prediction.",
                   {str(i): c["prefetch_reads"] for i, c in layers.items()}, "layer")
        w.metric("expert_cache_bytes", "gauge", "Bytes of routed experts held by the expert cache.",
                 experts["cached_bytes"])
        if experts["hit_rate"] is not None:
            w.metric("expert_cache_hit_rate", "gauge", "Expert-cache hit rate.", experts["hit_rate"])
    graph = stats["decode_graph"]
    if graph is not None:
        w.metric("decode_graph_steps_total", "counter", "Decode steps run as one compiled graph.", graph["steps"])
        w.metric("decode_graphs_compiled_total", "counter", "Decode graphs compiled (first batch size, then symbolic).",
                 graph["graphs"])
        w.metric("decode_graph_compile_seconds_total", "counter", "Seconds of the decode steps that compiled a graph.",
                 graph["compile_seconds"])
    w.metric("generation_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
             m.tokens_per_second())
    w.metric("prompt_tokens_total", "counter", "Prompt tokens computed (prefix-cache hits excluded).",
             m.prompt_tokens)
    w.metric("prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.",
             m.cached_prompt_tokens)
    w.metric("generation_tokens_total", "counter", "Generated tokens.", m.generation_tokens)
    w.labelled("requests_finished_total", "counter", "Finished requests by finish reason.",
               dict(m.requests_finished), "reason")
    w.metric("engine_steps_total", "counter", "Engine steps run.", m.steps)
    if engine.runner.drafts:
        w.metric("spec_decode_rounds_total", "counter", "Speculative rounds (one per sequence and step).",
                 m.spec_rounds)
        w.metric("spec_decode_num_draft_tokens_total", "counter", "Drafted tokens verified.", m.spec_drafted)
        w.metric("spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens accepted.", m.spec_accepted)
        w.metric("spec_decode_acceptance_length", "gauge", "Mean tokens committed per verification (accepted + 1).",
                 m.acceptance_length() or 0.0)
        w.labelled("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Accepted drafts by block position (1 = the first draft).",
                   {str(p): m.spec_accepted_at.get(p, 0) for p in range(1, engine.runner.drafts + 1)}, "position")
    return w.text()
