"""`openflash config show`, `plan`, `parity`, `verify`: inspecting configs, plans, goldens and checksums.

Each handler takes the parsed arguments and returns an exit code (cli.py declares the arguments)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from openflash.config import load_config
from openflash.errors import OpenflashError
from openflash.files.manifest import read_manifest, verify_manifest, write_manifest
from openflash.model.numerics import NUMERICS
from openflash.runtime.placement import resolve_device
from openflash.tools.parity import free_running_summary, run_golden
from openflash.tools.plan import build_plan, format_bytes
from openflash.topology import topology_table


def config_show(args: Any) -> int:
    cfg = load_config(args.config)
    if args.json:
        print(json.dumps({"layers": [t.as_dict() for t in cfg.topology.layers],
                          "decoder_start": cfg.topology.decoder_start}, indent=1))
    else:
        print(topology_table(cfg.topology))
        print(f"\nencoder: layers 0-{cfg.topology.decoder_start - 1}   "
              f"decoder: layers {cfg.topology.decoder_start}-{cfg.num_hidden_layers - 1}")
    return 0


def plan(args: Any) -> int:
    if args.memory is not None:
        return plan_memory(args)
    if args.accelerator_memory or args.out or args.measure:
        raise OpenflashError("--accelerator-memory, --measure and --out go with --memory")
    plan = build_plan(args.config, args.context, args.engram_placement)
    if args.json:
        print(json.dumps(asdict(plan), indent=1))
        return 0
    rows = [
        ("parameters, total", plan.params_total),
        ("  backbone (built)", plan.params_backbone),
        ("  Engram tables (built)", plan.params_engram_tables),
        ("  DSpark draft stages", plan.params_dspark),
        ("  vision tower + aligner", plan.params_vision),
        ("active per prompt token (encoder half, CED)", plan.active_prefill_token),
        ("active per generated token (all layers)", plan.active_decode_token),
    ]
    print(f"openflash plan: {plan.config}")
    for label, value in rows:
        print(f"  {label:<52} {value:>20,}")
    print("  bytes as stored (FP8 / FP4 / bf16), by location:")
    for where, n in plan.bytes_by_location.items():
        print(f"    {where:<50} {format_bytes(n):>20}")
    print(f"  global KV cache per token (FP4 main KV + MXFP4 index keys) {plan.kv_bytes_per_token:>13,} B")
    print(f"  window state per sequence (FP8 rings)                     {format_bytes(plan.window_bytes_per_sequence):>15}")
    print(f"  KV at {plan.context:,} tokens: {format_bytes(plan.kv_bytes_at_context)}")
    return 0


def plan_memory(args: Any) -> int:
    """`openflash plan MODEL --memory SIZE [--accelerator-memory SIZE] [--measure] [--out plan.json]`."""
    from openflash.tools.placement_plan import measure_bandwidth, plan_placement, write_placement

    memory, accelerator = args.memory, args.accelerator_memory  # bytes (sizes.size_bytes)
    bandwidth = measure_bandwidth() if args.measure else None
    p = plan_placement(args.config, memory, accelerator, args.context, args.batch, bandwidth)
    if args.out:
        write_placement(p, args.out)
    if args.json:
        print(json.dumps({"run": p.run_settings(), "plan": asdict(p)}, indent=1))
        return 0
    compute = "accelerator" if accelerator else "host"
    print(f"openflash plan: {args.config} in {format_bytes(memory)} of host RAM" +
          (f" + {format_bytes(accelerator)} of accelerator memory" if accelerator else "") +
          f", context {args.context:,} x batch {args.batch}")
    labels = {"dense": "dense weights (attention, shared experts, embed/head, ...)", "kv": "KV cache",
              "experts": "routed experts", "engram": "Engram tables"}
    for part in ("dense", "kv", "experts", "engram"):
        extra = ""
        if part == "experts" and p.where[part] != compute:
            extra = f" (cache of {format_bytes(p.expert_cache_bytes)} on the {compute})"
        print(f"  {labels[part]:<58} {format_bytes(p.parts[part]):>12}  -> {p.where[part]}{extra}")
    print(f"  bytes read per decode token ({'measured' if p.measured else 'default'} bandwidths):")
    for tier, n in p.bytes_per_token.items():
        print(f"    {tier:<24} {format_bytes(n):>12} at {p.bandwidth[tier] / 1e9:.1f} GB/s")
    print(f"  decode bound by those reads: {p.tokens_per_second:.2f} tokens/s")
    for note in p.notes:
        print(f"  note: {note}")
    if args.out:
        print(f"  placement written to {args.out}: run it with --placement {args.out}")
    return 0


def parity(args: Any) -> int:
    if args.numerics not in NUMERICS:
        raise OpenflashError(f"unknown numerics {args.numerics!r}")
    all_ok = True
    report = {}
    device = str(resolve_device(args.device))
    for folder in args.golden_dir:
        results = run_golden(folder, args.numerics, teacher_forced=True, weights=args.weights, device=device)
        free = free_running_summary(run_golden(folder, args.numerics, teacher_forced=False, weights=args.weights,
                                               device=device))
        ok = all(c.passed for c in results)
        all_ok &= ok
        report[folder] = {"pass": ok, "teacher_forced": [c.__dict__ for c in results], "free_running": free}
        if not args.json:
            print(f"== {folder} ({args.numerics} numerics, teacher-forced, {device}): {'PASS' if ok else 'FAIL'}")
            for c in results:
                if c.kind == "int":
                    print(f"  {'ok  ' if c.passed else 'FAIL'} {c.key:<40} exact: {c.note}")
                else:
                    print(f"  {'ok  ' if c.passed else 'FAIL'} {c.key:<40} max|d|={c.max_abs:.3e} "
                          f"max rel={c.max_rel:.3e} {c.note}")
            print(f"  free-running (informational): max logit |d| = {free['max_logit_abs_error']:.3e}, "
                  f"greedy tokens {'match' if free['generated_tokens_match'] else 'differ'}, "
                  f"first difference beyond tolerance: {free['first_mismatch']}")
    if args.json:
        print(json.dumps(report, indent=1))
    print("PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1


def verify(args: Any) -> int:
    """`openflash verify PATH [--write]`."""
    folder = Path(args.path)
    if not folder.is_dir():
        raise OpenflashError(f"{folder}: not a folder (give a checkpoint or Engram table folder)")
    if args.write:
        path = write_manifest(folder)
        print(f"wrote {path} ({len(read_manifest(folder))} files)")
        return 0
    print(verify_manifest(folder).summary())
    return 0


def synth(args: Any) -> int:
    """`openflash checkpoint synth CONFIG OUT [--layers N] [--experts N] [--seed S]`."""
    from openflash.tools.plan import format_bytes
    from openflash.tools.synth import synthesize

    report = synthesize(args.config, args.out, layers=args.layers, experts=args.experts, seed=args.seed,
                        vision=not args.no_vision, shard_bytes=args.shard_bytes,
                        dense_table_bytes=args.dense_table_bytes)
    sparse = f"; sparse Engram tables (zero rows): {', '.join(report.sparse_tables)}" if report.sparse_tables else ""
    print(f"{report.folder}: {report.tensors} tensors in {report.shards} shards, {format_bytes(report.logical_bytes)} "
          f"of tensors, {format_bytes(report.bytes_written)} written{sparse}")
    return 0


def lora_merge(args: Any) -> int:
    """`openflash lora merge BASE ADAPTER OUT`."""
    from openflash.tools.lora_merge import merge_adapter

    print(merge_adapter(args.base, args.adapter, args.out, resolve_device(args.device)).summary())
    return 0
