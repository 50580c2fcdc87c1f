"""Engram table placement: what each tier costs the `small` preset, with tables much larger than the backbone.

    python benchmarks/engram_offload.py [--table-gb 2] [--rounds 3] [--decode-steps 16] [--threads 1]

The `small` preset gets Engram tables of --table-gb GB in total (FP8 rows, engram_vocab_size raised in a config
copy, engram_num_embeddings from the prime search), random contents, written once as table files under
--table-dir. Every variant runs the same token streams (real text: Python stdlib sources, DeepSeek tokenizer,
ids folded into the preset's vocabulary) and the same sampler seeds, so all tiers must produce bit-identical
logits (checked every run). Variants:

    none           the same backbone without Engram layers (engram_layer_ids=[])
    device         tables in the model (DeviceTable), the reference for every ratio
    host           FP8 rows in RAM, gathered per step (on this CPU machine "host" and "device" share memory)
    disk-warm      memory-mapped table files, page cache warm (the files were just read)
    disk-cold      the files' pages dropped from the page cache before the run (posix_fadvise DONTNEED)
    disk-cold-cN%  cold, with a row cache of N% of each table
    .../sync       prefetch off: each Engram layer gathers its rows when it needs them
    .../spec       speculative prefetch: the top-k next tokens' rows are gathered as soon as logits exist

Scenarios: decode at batch 1 and batch 8 (a --prompt-len prefill, untimed, then --decode-steps steps that feed the
text's own continuation, so the rows read follow real text), a batch-1 prefill of --prefill-len tokens in one
chunk, and decode with greedy tokens from the model (speculation then always covers the token: the upper bound of
what it can remove). A decode step is timed from the previous step's logits: speculation, choosing the token,
hashing + prefetch submission, the step. Variants are interleaved round by round and each figure is the median over
rounds, so slow phases of a shared machine hit every variant alike.

Two losses against `device` (same run): `speed vs device` = device step time / variant step time (what a user
sees, noisy on a shared machine), and `Engram loss` = (main-thread Engram ms of the variant - that of device) /
device step ms, where main-thread Engram time is hashing + prefetch submission + speculation + waiting in the
Engram layers, plus the model's own table gather for device (measured directly, so it is not drowned by other
processes). `slack` is the time between a prefetch's submission and its layer asking for the rows.

Writes benchmarks/results/engram_offload.json and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from openflash.config import FlashConfig, load_config
from openflash.engine.sampling import SamplerState, SamplingParams, sample
from openflash.errors import EngramTableError
from openflash.memory.frontend import EngramFrontend
from openflash.memory.hashing import find_table_primes
from openflash.memory.placement import EngramMemory
from openflash.memory.table_file import read_table_header, table_file_name, write_table_file
from openflash.memory.tiers.disk import DiskTable
from openflash.model.engram_table import DeviceTable
from openflash.model.transformer import Transformer
from openflash.runtime.runtime import Runtime
from openflash.tokenizer import DEEPSEEK, load_tokenizer
from openflash.train.tokenizer import iter_text_files, stdlib_source_dir

RESULTS = Path(__file__).parent / "results"


# ----------------------------------------------------------------------------------------------------------------
# Setup: config, tables, models, text


def big_table_config(table_gb: float) -> FlashConfig:
    """The small preset with Engram tables of about `table_gb` GB in total (FP8 rows + UE8M0 scales)."""
    cfg = load_config("small")
    columns = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    row_bytes = cfg.engram_head_dim + cfg.engram_head_dim // 32
    per_layer = table_gb * 2**30 / len(cfg.engram_layer_ids)
    vocab = int(per_layer / row_bytes / columns)
    primes = find_table_primes(vocab, cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads)
    return cfg.replace(engram_vocab_size=vocab, engram_num_embeddings=[sum(p) for p in primes])


def table_arrays(cfg: FlashConfig, table_dir: Path, fingerprint: str) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per Engram layer id, (weight [rows, dim], scale [rows, dim/32]) uint8, identical to the table files.

    The files are written once with random rows (FP8 codes 0..126: finite, positive; scales near 2^0) and reused
    when their headers match."""
    dim, arrays = cfg.engram_head_dim, {}
    for lid, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings):
        path = table_dir / table_file_name(lid)
        try:
            header = read_table_header(path)
            reuse = (header.rows, header.dim, header.layout_fingerprint) == (rows, dim, fingerprint) and \
                path.stat().st_size == header.file_bytes
        except EngramTableError:
            reuse = False
        if reuse:
            records = np.fromfile(path, dtype=np.uint8, offset=header.data_offset).reshape(rows, -1)
            arrays[lid] = (np.ascontiguousarray(records[:, :dim]), np.ascontiguousarray(records[:, dim:]))
            del records
            continue
        print(f"writing {path} ({rows:,} rows, {rows * (dim + dim // 32) / 2**30:.2f} GiB)", flush=True)
        rng = np.random.default_rng(lid)
        weight = rng.integers(0, 127, size=(rows, dim), dtype=np.uint8)
        scale = rng.integers(120, 128, size=(rows, dim // 32), dtype=np.uint8)
        write_table_file(path, weight, scale, fingerprint, chunk_rows=1 << 20)
        arrays[lid] = (weight, scale)
    return arrays


def text_tokens(vocab_size: int, count: int) -> torch.Tensor:
    """`count` tokens of real text: stdlib sources through the DeepSeek tokenizer, ids folded into the vocabulary
    (folding keeps the text's repetition structure, which is what the row cache sees)."""
    tokenizer, ids = load_tokenizer(DEEPSEEK), []
    for path in iter_text_files([stdlib_source_dir()], ["*.py"]):
        ids.extend(tokenizer.encode(path.read_text(errors="replace")).ids)
        if len(ids) >= count:
            break
    return torch.tensor(ids[:count], dtype=torch.int64) % vocab_size


@dataclass
class Variant:
    name: str
    placement: str  # none | device | host | disk
    prefetch: bool = True
    pages: str = "warm"  # disk: warm | cold
    cache_fraction: float = 0.0  # disk: row cache per table, as a fraction of its bytes
    k: int = 0  # speculation candidates (0: off)
    runtime: Runtime | None = None  # the model with this variant's Engram memory
    results: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def memory(self) -> EngramMemory | None:
        return None if self.runtime is None else self.runtime.memory


def make_variants(args: argparse.Namespace) -> list[Variant]:
    k = args.speculate_k
    variants = [Variant("none", "none"), Variant("device", "device"),
                Variant("host", "host"), Variant("host/sync", "host", prefetch=False),
                Variant("host/spec", "host", k=k),
                Variant("disk-warm", "disk"), Variant("disk-warm/sync", "disk", prefetch=False),
                Variant("disk-warm/spec", "disk", k=k),
                Variant("disk-cold", "disk", pages="cold"),
                Variant("disk-cold/sync", "disk", prefetch=False, pages="cold"),
                Variant("disk-cold/spec", "disk", pages="cold", k=k)]
    for pct in args.cache_percent:
        variants.append(Variant(f"disk-cold-c{pct:g}%", "disk", pages="cold", cache_fraction=pct / 100))
    return variants


def build(variant: Variant, backbone: Transformer, no_engram: Transformer, cfg: FlashConfig,
          frontend: EngramFrontend, tables: dict[int, tuple[torch.Tensor, torch.Tensor]], args) -> None:
    tokenizer = load_tokenizer(DEEPSEEK)  # the steps read token ids; the runtime's tokenizer is for text
    if variant.placement == "none":  # no Engram layers: its memory prepares nothing
        variant.runtime = Runtime(no_engram, tokenizer, EngramMemory.attach(no_engram, "device"))
        return
    model = copy.deepcopy(backbone)
    # The preset-sized model gets the big tables (sharing one copy of their memory) and the big config; building
    # Transformer(cfg) directly would first allocate the tables as trainable fp32 (4x their FP8 bytes).
    for lid in cfg.engram_layer_ids:
        model.layers[lid].engram.embed = DeviceTable.from_fp8(*tables[lid])
    model.cfg = cfg
    row_bytes = cfg.engram_head_dim + cfg.engram_head_dim // 32
    cache_bytes = int(variant.cache_fraction * min(cfg.engram_num_embeddings) * row_bytes)
    # device: the memory gathers from the model's own tables when a layer asks, timed as that layer's wait. Each
    # variant's memory is attached here with its own prefetch and row-cache settings (the tiers being measured).
    memory = EngramMemory.attach(model, variant.placement, frontend=frontend, prefetch=variant.prefetch,
                                 table_dir=args.table_dir if variant.placement == "disk" else None,
                                 cache_bytes=cache_bytes, io_threads=args.io_threads)
    variant.runtime = Runtime(model, tokenizer, memory)


# ----------------------------------------------------------------------------------------------------------------
# Page cache control


class PageCache:
    """Keeps the table files warm or cold in the page cache for the variant about to run."""

    def __init__(self, table_dir: Path, cfg: FlashConfig, variants: list[Variant]) -> None:
        self.files = [table_dir / table_file_name(lid) for lid in cfg.engram_layer_ids]
        self.variants, self.state = variants, "unknown"

    def _disk_tables(self) -> list[DiskTable]:
        return [t for v in self.variants if v.memory is not None for t in v.memory.tables.values()
                if isinstance(t, DiskTable)]

    def cold(self) -> None:
        # Pages mapped by any open mapping stay resident, so every DiskTable drops its mapping's pages first.
        for table in self._disk_tables():
            table.drop_page_cache()
        self.state = "cold"

    def warm(self) -> None:
        if self.state == "warm":
            return
        buffer = bytearray(64 << 20)
        for path in self.files:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
        self.state = "warm"

    def prepare(self, variant: Variant) -> None:
        if variant.placement != "disk":
            return
        for table in variant.memory.tables.values():
            table.clear_cache()  # every run starts with an empty row cache
        self.cold() if variant.pages == "cold" else self.warm()


# ----------------------------------------------------------------------------------------------------------------
# Scenarios


def decode_run(variant: Variant, stream: torch.Tensor, prompt_len: int, steps: int,
               greedy: bool) -> tuple[list[float], torch.Tensor, float]:
    """Prefill stream[:, :prompt_len] (untimed), then `steps` decode steps, each timed from the previous step's
    logits: speculation, choosing the token, hashing + prefetch, the step. Tokens: the text's own continuation
    (teacher forcing, so the rows read follow real text), or greedy from the model. Returns (step seconds,
    last logits, mean top-k mass of the speculated distributions)."""
    rt = variant.runtime
    B = stream.shape[0]
    samplers = [SamplerState.create(SamplingParams(temperature=0.0)) for _ in range(B)]
    cache = rt.new_cache(B)
    logits = rt.step(stream[:, :prompt_len], cache)
    reset(variant)
    times, mass = [], []
    for t in range(steps):
        start = time.perf_counter()
        if variant.k:
            rt.speculate(logits, cache, variant.k)
            mass.append(float(logits.softmax(-1).topk(variant.k, dim=-1).values.sum(-1).mean()))
        tokens = sample(logits, samplers)[:, None] if greedy else stream[:, prompt_len + t, None]
        logits = rt.step(tokens, cache)
        times.append(time.perf_counter() - start)
    return times, logits, statistics.mean(mass) if mass else None


def prefill_run(variant: Variant, prompt: torch.Tensor) -> tuple[float, torch.Tensor]:
    rt = variant.runtime
    cache = rt.new_cache(prompt.shape[0])
    reset(variant)
    start = time.perf_counter()
    logits = rt.step(prompt, cache)
    return time.perf_counter() - start, logits


def reset(variant: Variant) -> None:
    variant.memory.reset_stats()


def run_stats(variant: Variant, steps: int) -> dict:
    """Per-step Engram figures (ms) of the run that just finished. engram_ms: main-thread time spent on Engram
    rows: hashing + submitting + speculation + waiting in the Engram layers (for device, the gather itself)."""
    s = variant.memory.stats()
    per = lambda d: {str(k): 1e3 * v / steps for k, v in d.items()}  # noqa: E731
    spec = s["speculation"]
    engram = s["prepare_seconds"] + s["speculate_seconds"] + sum(s["wait_seconds"].values())
    return {"wait_ms": per(s["wait_seconds"]), "slack_ms": per(s["slack_seconds"]),
            "fetch_ms": per(s["fetch_seconds"]), "engram_ms": 1e3 * engram / steps, "hit_rate": s["hit_rate"],
            "coverage": spec["coverage"] if spec["rows_checked"] else None,
            "rows_served": spec["rows_served"],
            "bytes_read": sum(t["bytes_read"] for t in s["tables"].values()) if s["tables"] else 0}


def summarize(records: list[dict]) -> dict:
    out = {"seconds": statistics.median(r["seconds"] for r in records), "identical": all(r["identical"]
                                                                                        for r in records)}
    out["engram_ms"] = statistics.median(r["engram_ms"] for r in records)
    for key in ("wait_ms", "slack_ms", "fetch_ms"):
        layers = records[0][key].keys()
        out[key] = {lid: statistics.median(r[key][lid] for r in records) for lid in layers}
    for key in ("hit_rate", "coverage", "top_k_mass"):
        values = [r[key] for r in records if r.get(key) is not None and r[key] == r[key]]
        out[key] = statistics.mean(values) if values else None
    out["bytes_read_per_run"] = statistics.mean(r["bytes_read"] for r in records)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--table-gb", type=float, default=2.0, help="total Engram table size, GB (default 2)")
    ap.add_argument("--table-dir", type=Path, default=Path("/tmp/openflash_engram_offload"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64, help="decode scenarios: prompt tokens (untimed)")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    ap.add_argument("--cache-percent", type=float, nargs="*", default=[1, 5, 20])
    ap.add_argument("--speculate-k", type=int, default=4)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine a second thread oversubscribes)")
    ap.add_argument("--keep-tables", action="store_true", help="keep the table files (default: delete at exit)")
    ap.add_argument("--out", type=Path, default=RESULTS / "engram_offload.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    started, load_before = time.perf_counter(), os.getloadavg()
    cfg = big_table_config(args.table_gb)
    small = load_config("small")
    torch.manual_seed(0)
    backbone = Transformer(small).eval()
    torch.manual_seed(0)
    no_engram = Transformer(small.replace(engram_layer_ids=[], engram_num_embeddings=[])).eval()
    backbone_bytes = sum(p.numel() * p.element_size() for n, p in backbone.named_parameters()
                         if ".engram.embed." not in n)
    frontend = EngramFrontend.for_config(cfg)
    args.table_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.table_dir).free
    table_bytes = sum(rows * (cfg.engram_head_dim + cfg.engram_head_dim // 32) for rows in cfg.engram_num_embeddings)
    if free < table_bytes:
        raise SystemExit(f"{args.table_dir}: {free / 2**30:.1f} GiB free, the tables need {table_bytes / 2**30:.1f}")
    arrays = table_arrays(cfg, args.table_dir, frontend.layout.layout_fingerprint())
    tables = {lid: (torch.from_numpy(w), torch.from_numpy(s)) for lid, (w, s) in arrays.items()}
    print(f"small preset: backbone {backbone_bytes / 2**20:.0f} MiB (fp32), Engram tables "
          f"{table_bytes / 2**30:.2f} GiB = {table_bytes / backbone_bytes:.0f}x, rows per layer "
          f"{cfg.engram_num_embeddings} (engram_vocab_size {cfg.engram_vocab_size:,})", flush=True)

    variants = make_variants(args)
    for variant in variants:
        build(variant, backbone, no_engram, cfg, frontend, tables, args)
    pages = PageCache(args.table_dir, cfg, variants)
    per_round = max(max(args.batch) * (args.prompt_len + args.decode_steps), args.prefill_len)
    text = text_tokens(cfg.vocab_size, args.rounds * per_round)
    greedy_names = {"device", "host", "host/spec", "disk-cold", "disk-cold/spec", "disk-warm", "disk-warm/spec"}

    scenarios = [(f"decode_b{b}", b, False) for b in args.batch] + [("prefill_b1", 1, None)] + \
        [(f"decode_b{b}_greedy", b, True) for b in args.batch]
    for r in range(args.rounds):
        offset = r * per_round
        for name, batch, greedy in scenarios:
            reference = None
            for variant in variants:
                if greedy and variant.name not in greedy_names:
                    continue
                pages.prepare(variant)
                if greedy is None:  # prefill
                    prompt = text[offset: offset + args.prefill_len][None]
                    seconds, logits = prefill_run(variant, prompt)
                    record = {"seconds": seconds, **run_stats(variant, 1)}
                else:
                    span = args.prompt_len + args.decode_steps
                    stream = text[offset: offset + batch * span].view(batch, span)
                    times, logits, mass = decode_run(variant, stream, args.prompt_len, args.decode_steps, greedy)
                    record = {"seconds": statistics.median(times), "top_k_mass": mass,
                              **run_stats(variant, args.decode_steps)}
                if variant.name == "device":
                    reference = logits
                record["identical"] = variant.name == "none" or (reference is not None and
                                                                 torch.equal(logits, reference))
                variant.results.setdefault(name, []).append(record)
        print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)", flush=True)

    report = {"config": {"preset": "small", "engram_vocab_size": cfg.engram_vocab_size,
                         "engram_num_embeddings": cfg.engram_num_embeddings, "table_bytes": table_bytes,
                         "backbone_bytes_fp32": backbone_bytes, "args": {k: str(v) for k, v in vars(args).items()},
                         "load_average_before": load_before, "load_average_after": os.getloadavg(),
                         "seconds": time.perf_counter() - started},
              "variants": {}}
    for variant in variants:
        report["variants"][variant.name] = {name: summarize(records) for name, records in variant.results.items()}
    device = report["variants"]["device"]
    for results in report["variants"].values():
        for name, summary in results.items():
            summary["speed_vs_device"] = device[name]["seconds"] / summary["seconds"]
            # Loss from directly measured main-thread Engram time (robust to a noisy shared machine).
            summary["engram_loss_vs_device"] = (summary["engram_ms"] - device[name]["engram_ms"]) / \
                (1e3 * device[name]["seconds"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print_table(report, scenarios, cfg)
    for variant in variants:
        variant.memory.close()
    if not args.keep_tables:
        for lid in cfg.engram_layer_ids:
            (args.table_dir / table_file_name(lid)).unlink(missing_ok=True)
    print(f"wrote {args.out}")


def print_table(report: dict, scenarios: list, cfg: FlashConfig) -> None:
    first, second = (str(lid) for lid in cfg.engram_layer_ids)
    prefill_len = int(report["config"]["args"]["prefill_len"])
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    for name, batch, greedy in scenarios:
        print(f"\n### {name}\n")
        print(f"| variant | {'ms' if greedy is None else 'ms/step'} | tok/s | speed vs device | Engram ms | "
              f"Engram loss | wait L{first} ms | wait L{second} ms | slack L{first} ms | hit rate | coverage | "
              f"identical |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|")
        for vname, results in report["variants"].items():
            if name not in results:
                continue
            s = results[name]
            tokens = prefill_len if greedy is None else batch
            wait = s["wait_ms"]
            print(f"| {vname} | {1e3 * s['seconds']:.1f} | {tokens / s['seconds']:.1f} | "
                  f"{s['speed_vs_device']:.3f} | {s['engram_ms']:.2f} | {pct(s['engram_loss_vs_device'])} | "
                  f"{fmt(wait.get(first))} | {fmt(wait.get(second))} | {fmt(s['slack_ms'].get(first))} | "
                  f"{pct(s['hit_rate'])} | {pct(s['coverage'])} | {'yes' if s['identical'] else 'NO'} |")


if __name__ == "__main__":
    main()
