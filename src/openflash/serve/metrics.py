"""GET /metrics: the engine's state and measurements through prometheus_client, read at each scrape.

`EngineCollector` turns the engine's own counters (engine/metrics.py, the one record of them) into metric families:
under `openflash_*` as before, and under the names vLLM's dashboards chart (`vllm:num_requests_running`,
`vllm:time_to_first_token_seconds`, `vllm:time_per_output_token_seconds`, `vllm:prompt_tokens_total`,
`vllm:prefix_cache_queries_total` / `_hits_total`, ... with a `model_name` label), so a Grafana board built for
vLLM works unchanged. Each server has its own registry (no global one), with the process, platform and GC
collectors beside the engine's.

Latencies are histograms (seconds): time to first token, inter-token latency, end-to-end request latency, queue
time, engine step time. Gauges: waiting / prefilling / running sequences, KV blocks in use and allocated, global
cache bytes per token, prefix-cache and Engram row-cache hit rates (the Engram one only with a tier that has a row
cache, e.g. disk), expert-cache hits, misses and bytes read per layer (with --expert-placement host or disk),
generated tokens per second over the last 10 s. Counters: prompt tokens computed and served from the prefix cache,
generated tokens, finished requests by reason, engine steps, and on the compiled backend the decode steps run as
one graph, the graphs compiled and the seconds spent compiling them.
"""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from openflash.engine.engine import LLMEngine
from openflash.engine.metrics import Histogram

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "openflash"
VLLM = "vllm:"  # the names vLLM exposes, for dashboards built on them


def _histogram(name: str, help_text: str, hist: Histogram, labels: dict[str, str] | None = None
               ) -> HistogramMetricFamily:
    cumulative, total, _ = hist.snapshot()
    buckets = [(repr(float(b)), c) for b, c in zip(hist.buckets, cumulative)] + [("+Inf", cumulative[-1])]
    family = HistogramMetricFamily(name, help_text, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), buckets, total)
    return family


def _one(kind: type, name: str, help_text: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    family = kind(name, help_text, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), value)
    return family


def _by(kind: type, name: str, help_text: str, values: dict[str, float], label: str) -> Metric:
    family = kind(name, help_text, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


class EngineCollector:
    """The engine's metrics at scrape time (module doc)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        yield from self._openflash()
        yield from self._vllm()

    def _openflash(self) -> Iterator[Metric]:
        engine = self.engine
        m, stats = engine.metrics, engine.stats()

        def name(short: str) -> str:
            return f"{PREFIX}_{short}"

        yield _histogram(name("time_to_first_token_seconds"), "Time from arrival to the first generated token.",
                         m.ttft)
        yield _histogram(name("inter_token_latency_seconds"), "Time between consecutive tokens of a request.", m.itl)
        yield _histogram(name("e2e_request_latency_seconds"), "Time from arrival to the end of a request.", m.e2e)
        yield _histogram(name("queue_time_seconds"), "Time from arrival to admission.", m.queue_time)
        yield _histogram(name("engine_step_seconds"), "Duration of one engine step.", m.step_time)
        yield _one(GaugeMetricFamily, name("num_requests_waiting"), "Requests waiting to be admitted.",
                   stats["waiting"])
        yield _one(GaugeMetricFamily, name("num_requests_prefilling"), "Requests whose prompt is being prefilled.",
                   stats["prefilling"])
        yield _one(GaugeMetricFamily, name("num_requests_running"), "Sequences in the decode batch.",
                   stats["running"])
        yield _one(GaugeMetricFamily, name("kv_blocks_in_use"),
                   "Global-cache blocks referenced (sequences and prefix cache).", stats["kv_blocks_in_use"])
        yield _one(GaugeMetricFamily, name("kv_blocks_allocated"), "Global-cache blocks allocated in the pool.",
                   stats["kv_blocks_total"])
        yield _one(GaugeMetricFamily, name("kv_cache_bytes_per_token"),
                   "Global compressed-cache bytes per token (all KV-owner layers).",
                   stats["global_cache_bytes_per_token"])
        pc = stats["prefix_cache"]
        if pc is not None:
            yield _one(GaugeMetricFamily, name("prefix_cache_hit_rate"),
                       "Fraction of prompts that reused a cached prefix.", pc["hit_rate"])
            yield _one(GaugeMetricFamily, name("prefix_cache_token_hit_rate"),
                       "Fraction of prompt tokens served from the prefix cache.", pc["token_hit_rate"])
            yield _one(GaugeMetricFamily, name("prefix_cache_entries"), "Cached prefixes.", pc["entries"])
            yield _one(GaugeMetricFamily, name("prefix_cache_bytes"), "Bytes held by the prefix cache.", pc["bytes"])
        engram = stats["engram"]
        if engram is not None and engram.get("hit_rate") is not None:
            yield _one(GaugeMetricFamily, name("engram_cache_hit_rate"), "Engram row-cache hit rate.",
                       engram["hit_rate"])
        experts = stats["experts"]
        if experts is not None:
            layers = experts["layers"]
            for short, key, text in (
                    ("expert_cache_hits_total", "hits", "Routed experts found in the expert cache, by layer."),
                    ("expert_cache_misses_total", "misses", "Routed experts fetched from host or disk, by layer."),
                    ("expert_bytes_read_total", "bytes_read", "Bytes of routed experts read (disk, or host to device)."),
                    ("expert_prefetched_total", "prefetched", "Expert-cache misses a prefetch read had already started."),
                    ("expert_prefetch_reads_total", "prefetch_reads", "Routed experts read on a router's prediction.")):
                yield _by(CounterMetricFamily, name(short), text, {str(i): c[key] for i, c in layers.items()}, "layer")
            yield _one(GaugeMetricFamily, name("expert_cache_bytes"),
                       "Bytes of routed experts held by the expert cache.", experts["cached_bytes"])
            if experts["hit_rate"] is not None:
                yield _one(GaugeMetricFamily, name("expert_cache_hit_rate"), "Expert-cache hit rate.",
                           experts["hit_rate"])
        graph = stats["decode_graph"]
        if graph is not None:
            yield _one(CounterMetricFamily, name("decode_graph_steps_total"), "Decode steps run as one compiled graph.",
                       graph["steps"])
            yield _one(CounterMetricFamily, name("decode_graphs_compiled_total"),
                       "Decode graphs compiled (first batch size, then symbolic).", graph["graphs"])
            yield _one(CounterMetricFamily, name("decode_graph_compile_seconds_total"),
                       "Seconds of the decode steps that compiled a graph.", graph["compile_seconds"])
            if "cuda_graph_replays" in graph:
                yield _one(CounterMetricFamily, name("cuda_graph_replays_total"),
                           "Decode steps replayed from a CUDA graph recording.", graph["cuda_graph_replays"])
        yield _one(GaugeMetricFamily, name("generation_tokens_per_second"),
                   "Generated tokens per second over the last 10 s.", m.tokens_per_second())
        yield _one(CounterMetricFamily, name("prompt_tokens_total"),
                   "Prompt tokens computed (prefix-cache hits excluded).", m.prompt_tokens)
        yield _one(CounterMetricFamily, name("prompt_tokens_cached_total"),
                   "Prompt tokens served from the prefix cache.", m.cached_prompt_tokens)
        yield _one(CounterMetricFamily, name("generation_tokens_total"), "Generated tokens.", m.generation_tokens)
        yield _by(CounterMetricFamily, name("requests_finished_total"), "Finished requests by finish reason.",
                  dict(m.requests_finished), "reason")
        yield _one(CounterMetricFamily, name("engine_steps_total"), "Engine steps run.", m.steps)
        if engine.runner.drafts:
            yield _one(CounterMetricFamily, name("spec_decode_rounds_total"),
                       "Speculative rounds (one per sequence and step).", m.spec_rounds)
            yield _one(CounterMetricFamily, name("spec_decode_num_draft_tokens_total"), "Drafted tokens verified.",
                       m.spec_drafted)
            yield _one(CounterMetricFamily, name("spec_decode_num_accepted_tokens_total"), "Drafted tokens accepted.",
                       m.spec_accepted)
            yield _one(GaugeMetricFamily, name("spec_decode_acceptance_length"),
                       "Mean tokens committed per verification (accepted + 1).", m.acceptance_length() or 0.0)
            yield _by(CounterMetricFamily, name("spec_decode_num_accepted_tokens_per_pos_total"),
                      "Accepted drafts by block position (1 = the first draft).",
                      {str(p): m.spec_accepted_at.get(p, 0) for p in range(1, engine.runner.drafts + 1)}, "position")

    def _vllm(self) -> Iterator[Metric]:
        """The same measurements under vLLM's names (and its model_name label)."""
        m, stats = self.engine.metrics, self.engine.stats()
        model = {"model_name": self.model_name}
        yield _one(GaugeMetricFamily, f"{VLLM}num_requests_running", "Requests in the decode batch.",
                   stats["running"] + stats["prefilling"], model)
        yield _one(GaugeMetricFamily, f"{VLLM}num_requests_waiting", "Requests waiting to be admitted.",
                   stats["waiting"], model)
        yield _histogram(f"{VLLM}time_to_first_token_seconds", "Time to first token.", m.ttft, model)
        yield _histogram(f"{VLLM}time_per_output_token_seconds", "Time per output token (inter-token latency).",
                         m.itl, model)
        yield _histogram(f"{VLLM}e2e_request_latency_seconds", "End-to-end request latency.", m.e2e, model)
        yield _histogram(f"{VLLM}request_queue_time_seconds", "Time waiting before admission.", m.queue_time, model)
        yield _one(CounterMetricFamily, f"{VLLM}prompt_tokens_total", "Prompt tokens (computed and cached).",
                   m.prompt_tokens + m.cached_prompt_tokens, model)
        yield _one(CounterMetricFamily, f"{VLLM}generation_tokens_total", "Generated tokens.", m.generation_tokens,
                   model)
        yield _one(CounterMetricFamily, f"{VLLM}prefix_cache_queries_total", "Prompt tokens looked up in the prefix "
                   "cache.", m.prompt_tokens + m.cached_prompt_tokens, model)
        yield _one(CounterMetricFamily, f"{VLLM}prefix_cache_hits_total", "Prompt tokens served from the prefix "
                   "cache.", m.cached_prompt_tokens, model)
        finished = CounterMetricFamily(f"{VLLM}request_success_total", "Finished requests by finish reason.",
                                       labels=["model_name", "finished_reason"])
        for reason, count in sorted(m.requests_finished.items()):
            finished.add_metric([self.model_name, reason], count)
        yield finished


def metrics_registry(engine: LLMEngine, model_name: str, process: bool = True) -> CollectorRegistry:
    """A registry of the engine's metrics (and, with `process`, the process, platform and GC collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    if process:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode("utf-8")


def render(engine: LLMEngine, model_name: str = PREFIX) -> str:
    """The engine's metrics alone in the exposition format (tests and benchmarks; the server adds the process's)."""
    return exposition(metrics_registry(engine, model_name, process=False))


__all__ = ["EngineCollector", "metrics_registry", "exposition", "render", "CONTENT_TYPE"]
