"""The flags several `openflash` commands share, declared once (cli.py declares each command's own): where a model
runs for inference (placement.Placement.from_args reads them), the compiled backend, and token ids typed on the
command line."""

from __future__ import annotations

import argparse

from openflash.runtime.placement import DEVICE_HELP, ENGRAM_TIERS, EXPERT_TIERS
from openflash.sizes import SIZE_HELP, size_bytes

WEIGHTS_HELP = ("weights: dequantized (fp32 copies of FP8/FP4/bf16 weights), stored (only the stored bytes resident, "
                "computed by the native kernels up to 16 rows, dequantized tile by tile beyond: memory = checkpoint "
                "size), auto (the default: stored where the kernels decode a quantized model of hidden size 256 or "
                "more faster, or where the fp32 copies would take over a quarter of the available memory)")


def compile_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", action="store_true",
                        help="run the compiled backend: the kernels' elementwise chains fused by torch.compile, same "
                             "numerics (needs a C++ compiler on CPU; the first call of each kernel compiles, cached "
                             "on disk by inductor; speed-ups in docs/benchmarks.md)")


def device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)


def placement_flags(parser: argparse.ArgumentParser) -> None:
    """Where the model runs (placement.Placement.from_args reads these): declared once for every command that
    places a model for inference."""
    device_flag(parser)
    parser.add_argument("--weights", default="auto", choices=["auto", "dequantized", "stored"], help=WEIGHTS_HELP)
    compile_flag(parser)
    parser.add_argument("--placement", default=None, metavar="plan.json",
                        help="run with the placement `openflash plan --memory ... --out plan.json` wrote (weights, "
                             "experts and their cache, Engram tier); not combined with those flags")
    parser.add_argument("--expert-placement", default="device", choices=list(EXPERT_TIERS),
                        help="where the routed experts live: device (the model's memory, default), host (read once "
                             "into host RAM, as stored), disk (read from the checkpoint's shards when routed to)")
    parser.add_argument("--expert-cache-bytes", type=size_bytes, default=0, metavar="SIZE",
                        help=f"with host / disk: recently used experts kept ready (LRU; 0 = no limit); {SIZE_HELP}")
    parser.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                        help="split the routed experts over N processes (launch with torchrun --nproc_per_node N; gloo "
                             "on CPU, nccl on GPU): each holds 1/N of them, the rest is replicated; a server's rank 0 "
                             "takes the requests and every rank runs the same engine steps")
    parser.add_argument("--expert-prefetch", action="store_true",
                        help="with disk: decode steps start reading the experts this and the next layer's routers "
                             "predict (off by default: slower where disk reads dominate; docs/benchmarks.md)")
    parser.add_argument("--expert-direct-io", action="store_true",
                        help="with host / disk: read the experts from the shards with O_DIRECT, past the page cache "
                             "(off by default: the page cache also serves re-reads; benchmarks/expert_reads.py)")
    parser.add_argument("--engram-placement", default="auto", choices=list(ENGRAM_TIERS),
                        help="where the Engram tables live: auto (host RAM next to a CUDA device for FP8 tables, "
                             "pinned, rows copied ahead; the model's memory on the CPU), device, host, disk")
    parser.add_argument("--engram-table-dir", default=None,
                        help="folder of table files from `openflash engram export` (disk placement)")
    parser.add_argument("--engram-cache-bytes", type=size_bytes, default=0, metavar="SIZE",
                        help=f"row cache of the disk tier (0: 64 MiB a table); {SIZE_HELP}")
    parser.add_argument("--engram-io-threads", type=int, default=4, help="parallel reads of the disk tier")


def token_ids(text: str) -> list[int]:
    """--prompt-ids: "0,5,17", "0 5 17" or "[0, 5, 17]"."""
    pieces = text.strip().strip("[]").replace(",", " ").split()
    try:
        ids = [int(p) for p in pieces]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids are integers separated by commas or spaces, got {text!r}") \
            from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids are one or more integers >= 0, got {text!r}")
    return ids
