"""benchmarks/gpu.py's `kernels` section: the Triton kernels at the released shapes, each beside the PyTorch path
it replaces, on the device a `Device` names (CUDA; the CPU in Triton's interpreter for gpu.py --dry-run, at toy
sizes):

- products on stored FP8 / MXFP4 weights (kernels/triton_products.py) beside dequantize-then-matmul, 1 to 1024
  rows: microseconds, GB/s of stored bytes read, TFLOP/s;
- a MoE layer's routed experts in one call (kernels/triton_experts.py) beside one call per expert, 1 to 256 tokens;
- the indexer's scores from the packed pool (kernels/triton_index.py) beside the keys read out, 32K and 256K
  entries;
- a decode step's attention of one layer, its window ring and 512 picked entries read in place
  (kernels/triton_attention.py) beside both read out and attended by the fp32 ops, 1 to 64 query rows.

GB/s are of the stored bytes each kernel reads: compare them with gpu.py's `hardware` copy of the same run.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Protocol

import torch


class Device(Protocol):
    """What a section needs of gpu.py's Bench."""

    device: torch.device
    dry: bool  # toy sizes on the CPU

    def sync(self) -> None: ...


def median_s(b: Device, fn: Callable[[], Any], runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        b.sync()
        t = time.perf_counter()
        fn()
        b.sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def kernels(b: Device) -> dict[str, Any]:
    """Products on stored weights at the released shapes (wq_a, wq_b: FP8; an expert's w1, w2: MXFP4), the Triton
    kernel beside dequantizing the weight and multiplying in fp32 (what a stored weight cost on CUDA before)."""
    from openflash import formats
    from openflash.kernels.triton_products import stored_product

    shapes = [("fp8", 1280, 5120), ("fp8", 32768, 1280), ("fp4", 2304, 5120), ("fp4", 5120, 2304)]
    rows, runs = (1, 16, 64, 1024), 20
    if b.dry:
        shapes, rows, runs = [("fp8", 64, 64), ("fp4", 64, 64)], (1, 17), 1
    out: dict[str, Any] = {}
    for storage, n, k in shapes:
        values = torch.randn(n, k, device=b.device)
        if storage == "fp8":
            weight = formats.e4m3_encode(values)
            scale = torch.full((-(-n // 32), k // 32), 127, dtype=torch.uint8, device=b.device)
            decoded = formats.e4m3_decode
            expand = lambda s: s.repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)  # noqa: E731
        else:
            weight = formats.pack_fp4(formats.e2m1_encode(values.clamp(-6, 6)))
            scale = torch.full((n, k // 32), 127, dtype=torch.uint8, device=b.device)
            decoded = lambda w: formats.e2m1_decode(formats.unpack_fp4(w))  # noqa: E731
            expand = lambda s: s.repeat_interleave(32, 1)  # noqa: E731
        stored_bytes = weight.numel() + scale.numel()
        for r in rows:
            x = torch.randn(r, k, device=b.device)
            kernel_s = median_s(b, lambda: stored_product(x, weight, scale, storage, True), runs)
            dequant_s = median_s(b, lambda: formats.act_quant_qdq(x) @ (decoded(weight) * expand(
                formats.ue8m0_decode(scale))).t(), runs)
            out[f"{storage} {n}x{k} rows {r}"] = {
                "kernel_us": round(kernel_s * 1e6, 1), "dequantized_us": round(dequant_s * 1e6, 1),
                "kernel_GBps": round(stored_bytes / kernel_s / 1e9, 1),
                "kernel_TFLOPs": round(2 * r * n * k / kernel_s / 1e12, 2)}
    out.update(_experts(b))
    out.update(_index_scores(b))
    out.update(_cache_attention(b))
    return out


def _index_scores(b: Device) -> dict[str, Any]:
    """The indexer's scores of one decode query at the released widths (32 heads, 128-wide MXFP4 keys, packed
    pool) over 32K to 256K entries (128K to 1M tokens at ratio 4): kernels/triton_index.py from the pool beside the
    keys read out and scored by the fp32 ops."""
    from openflash import formats
    from openflash.engine.block_pool import BlockPool, EntryLayout
    from openflash.engine.cache import PagedCompressedCache
    from openflash.kernels.triton_index import paged_index_scores
    from openflash.model.indexer import index_scores

    H, D, runs = (32, 128, 20) if not b.dry else (4, 32, 1)
    out: dict[str, Any] = {}
    for n in ((32768, 262144) if not b.dry else (100,)):
        pool = BlockPool(EntryLayout(512 if not b.dry else 32, D, "packed"), block_size=64, initial_blocks=2,
                         device=b.device)
        store = PagedCompressedCache.empty(pool, 1, 4, 512 if not b.dry else 32, device=b.device)
        keys = formats.fp4_qdq_ue8m0(torch.randn(n, D, device=b.device))
        store.write(torch.zeros(n, dtype=torch.long, device=b.device), torch.arange(n, device=b.device),
                    torch.zeros(n, pool.layout.head_dim, device=b.device), keys)
        q = formats.fp4_qdq_ue8m0(torch.randn(1, 1, H, D, device=b.device))
        w = torch.randn(1, 1, H, device=b.device)
        table = store.device_table
        args = (q.view(1, H, D), w.view(1, H), torch.zeros(1, dtype=torch.long, device=b.device), table,
                pool.planes["index_k"], pool.planes["index_scale"], n, True)
        kernel_s = median_s(b, lambda: paged_index_scores(*args), runs)
        read_s = median_s(b, lambda: index_scores(q, store.read_index(n), w), runs)
        error = (paged_index_scores(*args) - index_scores(q, store.read_index(n), w).view(1, n)).abs().max()
        out[f"index scores {n} entries"] = {
            "kernel_us": round(kernel_s * 1e6, 1), "read_out_us": round(read_s * 1e6, 1),
            "kernel_GBps": round(n * (D // 2 + D // 32) / kernel_s / 1e9, 1),
            "max_abs_diff": float(f"{float(error):.2g}")}
    return out


def _experts(b: Device) -> dict[str, Any]:
    """A MoE layer's routed experts at the released shapes (K 5120, I 2304, 6 of 32 experts a token): the one-call
    Triton kernels (kernels/triton_experts.py: per pair up to 16 pairs, tiled past them) beside one stored_product
    call per expert and projection."""
    from openflash import formats
    from openflash.kernels.triton_experts import fp4_experts
    from openflash.kernels.triton_products import stored_product

    K, I, E, k, runs = (5120, 2304, 32, 6, 20) if not b.dry else (64, 64, 4, 2, 1)
    gen = torch.Generator(device=b.device).manual_seed(0)

    def fp4(n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        codes = torch.randint(0, 16, (n, width), generator=gen, device=b.device, dtype=torch.uint8)
        return formats.pack_fp4(codes), torch.full((n, width // 32), 124, dtype=torch.uint8, device=b.device)

    made = [[fp4(n, width) for _ in range(E)] for n, width in ((I, K), (I, K), (K, I))]
    parts = [[m[j] for m in made[i]] for i in range(3) for j in range(2)]  # w1, s1, w3, s3, w2, s2
    out: dict[str, Any] = {}
    for tokens in ((1, 4, 16, 256) if not b.dry else (1, 3, 20)):
        x = torch.randn(tokens, K, device=b.device)
        expert = torch.stack([torch.randperm(E, generator=gen, device=b.device)[:k] for _ in range(tokens)]).flatten()
        token = torch.arange(tokens, device=b.device).repeat_interleave(k)
        weight = torch.rand(tokens * k, generator=gen, device=b.device)
        touched = expert.unique().tolist()
        stored_bytes = len(touched) * sum(t[0].numel() + t[1].numel() for t in (made[0][0], made[1][0], made[2][0]))

        def per_expert() -> torch.Tensor:
            y = torch.zeros_like(x)
            for e in touched:
                rows = token[expert == e]
                xe = x[rows]
                g = stored_product(xe, parts[0][e], parts[1][e], "fp4", True).clamp(max=10.0)
                u = stored_product(xe, parts[2][e], parts[3][e], "fp4", True).clamp(-10.0, 10.0)
                h = weight[expert == e, None] * torch.nn.functional.silu(g) * u
                y.index_add_(0, rows, stored_product(h, parts[4][e], parts[5][e], "fp4", True))
            return y

        one_s = median_s(b, lambda: fp4_experts(x, *parts, token, expert, weight, 10.0, True), runs)
        each_s = median_s(b, per_expert, runs)
        want = per_expert()  # the same sums in another order: equal to fp32 rounding
        error = ((fp4_experts(x, *parts, token, expert, weight, 10.0, True) - want).abs().max()
                 / want.abs().max().clamp(min=1e-30))
        out[f"fp4 experts {E}x(3x{I}x{K}) tokens {tokens}"] = {
            "one_call_us": round(one_s * 1e6, 1), "per_expert_us": round(each_s * 1e6, 1),
            "one_call_GBps": round(stored_bytes / one_s / 1e9, 1), "experts_touched": len(touched),
            "max_rel_diff": float(f"{float(error):.2g}")}
    return out


def _cache_attention(b: Device) -> dict[str, Any]:
    """A decode step's attention of one layer at the released widths (64 heads of 512, 512 picks a query row from a
    pool of 32K packed entries, a packed 128-slot window ring), as model/attention.py runs it: the ring and the picked
    entries attended in place by kernels/triton_attention.py and merged (`sparse_attention` with parts), beside the
    ring decoded and the picks gathered to fp32 and attended by `sparse_attention` alone."""
    from openflash import formats
    from openflash.engine.block_pool import BlockPool, EntryLayout
    from openflash.engine.cache import PackedWindowCache, PagedCompressedCache
    from openflash.kernels.triton_attention import picked_attention, ring_attention
    from openflash.model.sink_attention import sparse_attention

    H, D, K, W, n, runs = (64, 512, 512, 128, 32768, 20) if not b.dry else (4, 64, 40, 16, 100, 1)
    dev, scale = b.device, D ** -0.5
    gen = torch.Generator(device=dev).manual_seed(1)
    out: dict[str, Any] = {}
    for rows in ((1, 16, 64) if not b.dry else (1, 3)):
        pool = BlockPool(EntryLayout(D, 128, "packed"), block_size=64, initial_blocks=2, device=dev)
        store = PagedCompressedCache.empty(pool, rows, 4, D, device=dev)
        entries = formats.fp4_qdq_e4m3(torch.randn(n, D, generator=gen, device=dev))
        for r in range(rows):  # (every row the same entries: the reads are what is timed)
            store.write(torch.full((n,), r, device=dev), torch.arange(n, device=dev), entries,
                        torch.zeros(n, 128, device=dev))
        ring = PackedWindowCache.empty(rows, W, D, device=dev)
        positions = torch.arange(n * 4 - W, n * 4, device=dev).expand(rows, W)
        ring.write(formats.act_quant_qdq(torch.randn(rows, W, D, generator=gen, device=dev)), positions,
                   torch.ones(rows, W, dtype=torch.bool, device=dev))
        q = torch.randn(rows, 1, H, D, generator=gen, device=dev)
        kv = formats.act_quant_qdq(torch.randn(rows, 1, D, generator=gen, device=dev))  # the query token's own
        pos = torch.full((rows, 1), n * 4, device=dev)
        picks = torch.stack([torch.randperm(n, generator=gen, device=dev)[:K] for _ in range(rows)]).view(rows, 1, K)
        sink = torch.zeros(H, device=dev)
        planes = pool.planes
        own = torch.ones(rows, 1, 1, dtype=torch.bool, device=dev)
        no_picks = (kv.new_zeros(rows, 1, 0, D), torch.zeros(rows, 1, 0, dtype=torch.bool, device=dev))

        def in_place() -> torch.Tensor:
            parts = (ring_attention(q, pos, ring.codes, ring.scales, ring.pos, W, scale, True),
                     picked_attention(q, picks, store.device_table, planes["kv"], planes["kv_scale"], scale, True))
            return sparse_attention(q, kv, own, *no_picks, sink, scale, lambda x: x, parts)[0]

        def read_out() -> torch.Tensor:
            window_kv = torch.cat((ring.kv, kv), dim=1)
            kp = torch.cat((ring.pos, pos), dim=1).unsqueeze(1)
            mask = (kp >= 0) & (kp <= pos.unsqueeze(2)) & (kp > pos.unsqueeze(2) - W)
            return sparse_attention(q, window_kv, mask, store.gather(picks), picks >= 0, sink, scale, lambda x: x)[0]

        kernel_s, read_s = median_s(b, in_place, runs), median_s(b, read_out, runs)
        want = read_out()
        error = (in_place() - want).abs().max() / want.abs().max().clamp(min=1e-30)
        stored = rows * (K * (D // 2 + D // 16) + W * (D + D // 32))
        out[f"cache attention rows {rows}"] = {
            "in_place_us": round(kernel_s * 1e6, 1), "read_out_us": round(read_s * 1e6, 1),
            "in_place_GBps": round(stored / kernel_s / 1e9, 1), "max_rel_diff": float(f"{float(error):.2g}")}
    return out
