"""`openflash generate` and `serve`: running a model.

Each handler takes the parsed arguments and returns an exit code (cli.py declares the arguments). The flags are
checked before torch is imported (seconds), so a wrong one is refused at once."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openflash.errors import OpenflashError
from openflash.runtime.placement import Placement

if TYPE_CHECKING:
    from openflash.engine.sampling import SamplingParams
    from openflash.runtime.runtime import Runtime

log = logging.getLogger("openflash.serve")


def generate(args: Any) -> int:
    """`openflash generate --model M --prompt P`: one completion with the incremental path."""
    placement, group = _placed(args)
    from openflash.runtime.open import open_model

    loaded = open_model(args.model, args.tokenizer, args.numerics, placement, verify=args.verify, expert_group=group)
    if args.lora is not None:
        loaded.load_adapters({"adapter": args.lora}, verify=args.verify)
    if group is not None and group.rank != 0:  # every rank runs the same steps; rank 0 prints
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            return _generate(loaded, args)
    return _generate(loaded, args)


def _placed(args: Any) -> tuple[Placement, Any]:
    """The placement the flags (or --placement plan.json) give, and with --expert-parallel N this process's group
    (torchrun's environment; experts on the host unless placed)."""
    placement = Placement.from_args(args)
    if args.expert_parallel == 1:
        return placement, None
    from openflash.train.distributed import init_from_env

    if args.expert_parallel < 1:
        raise OpenflashError(f"--expert-parallel must be >= 1, got {args.expert_parallel}")
    if int(os.environ.get("WORLD_SIZE", "1")) != args.expert_parallel:
        raise OpenflashError(f"--expert-parallel {args.expert_parallel} runs as that many processes: launch with "
                             f"`torchrun --nproc_per_node {args.expert_parallel} -m openflash.cli {args.command} ...` "
                             f"(WORLD_SIZE is {os.environ.get('WORLD_SIZE', 'unset')})")
    if args.speculative is not None:
        raise OpenflashError("--expert-parallel does not combine with --speculative yet")
    if placement.experts == "device":
        placement = placement.with_(experts="host")  # each rank holds its share in RAM, as stored
    return placement, init_from_env(placement.torch_device)


def _generate(loaded: Runtime, args: Any) -> int:
    from openflash.engine.generate import generate as generate_text
    from openflash.engine.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    ids, images = loaded.prompt_ids(args.prompt if args.prompt_ids is None else args.prompt_ids, args.image)
    if args.speculative is not None:
        return _generate_speculative(loaded, args, params, ids, images)
    result = generate_text(loaded, ids, params, mode=args.prefill_mode, images=images,
                           adapter=None if args.lora is None else "adapter")
    print(f"# {loaded.note}")
    print(_shown_prompt(loaded, args) + result.text)
    if args.prompt_ids is not None:
        print(f"# generated ids: {result.token_ids}")
    print(f"# {result.prompt_tokens} prompt tokens, {len(result.token_ids)} generated ({result.finish_reason}); "
          f"prefill {result.prefill_seconds:.2f}s, decode {result.decode_tokens_per_second:.1f} tokens/s"
          + (" (compiled backend: first calls include compilation)" if args.compile else ""))
    if loaded.experts is not None:
        s = loaded.experts.summary()
        print(f"# experts ({s['placement']}): {s['hits']} cache hits, {s['misses']} misses, {s['bytes_read']:,} bytes "
              f"read in {s['read_seconds']:.2f}s")
    return 0


def _shown_prompt(loaded: Runtime, args: Any) -> str:
    return args.prompt if args.prompt_ids is None else loaded.tokenizer.decode(args.prompt_ids)


def _generate_speculative(loaded: Runtime, args: Any, params: SamplingParams, ids: list[int],
                          images: list[Any]) -> int:
    """`generate --speculative dspark`: the engine's speculative rounds on one request."""
    from openflash.engine.config import EngineConfig
    from openflash.engine.engine import LLMEngine

    engine = LLMEngine(loaded, EngineConfig(
        max_batch=1, max_context=len(ids) + args.max_tokens + 1, speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens, prefill_mode=args.prefill_mode))
    seq = engine.generate([ids], params, images=[images], adapters=[None if args.lora is None else "adapter"])[0]
    m = engine.metrics
    decode = seq.token_times[-1] - seq.token_times[0] if len(seq.token_times) > 1 else float("nan")
    print(f"# {loaded.note}")
    print(_shown_prompt(loaded, args) + seq.text)
    if args.prompt_ids is not None:
        print(f"# generated ids: {seq.output_ids}")
    print(f"# {seq.prompt_len} prompt tokens, {len(seq.output_ids)} generated ({seq.finish_reason}); "
          f"{m.spec_rounds} rounds, {m.acceptance_length() or 0:.2f} tokens per verification, "
          f"{m.spec_accepted}/{m.spec_drafted} drafts accepted; decode {(len(seq.output_ids) - 1) / decode:.1f} "
          f"tokens/s")
    return 0


def lora_modules(given: list[str], base_name: str) -> dict[str, str]:
    """`--lora NAME=PATH` arguments as name -> path (names distinct, none the base model's)."""
    named: dict[str, str] = {}
    for item in given:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise OpenflashError(f"--lora {item!r}: expected NAME=PATH (the model name requests use, and the adapter "
                                 f"folder or `train --lora` run)")
        if name in named or name == base_name:
            raise OpenflashError(f"--lora {item!r}: the name {name!r} is taken (by another adapter or the base model)")
        named[name] = path
    return named


def serve(args: Any) -> int:
    """`openflash serve --model M`: the OpenAI-compatible server (serve/app.py) over an engine (engine/)."""
    import uvicorn

    from openflash.chat import chat_format
    from openflash.config import PRESETS
    from openflash.engine.config import EngineConfig
    from openflash.engine.engine import LLMEngine
    from openflash.engine.lockstep import Lockstep
    from openflash.runtime.open import open_model
    from openflash.serve.app import ServerConfig, build_app
    from openflash.serve.images import ImagePolicy
    from openflash.vision.preprocess import ImageLimits

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_request_bytes < 1:
        raise OpenflashError(f"--max-request-bytes must be >= 1 (got {args.max_request_bytes})")
    if not args.body_timeout > 0:
        raise OpenflashError(f"--body-timeout must be > 0 seconds (got {args.body_timeout})")
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENFLASH_API_KEY")
    if api_key is not None and not api_key.strip():
        source = "--api-key" if args.api_key is not None else "OPENFLASH_API_KEY"
        raise OpenflashError(f"{source} is empty: that would turn authentication off; give a key, or leave it unset "
                             f"to serve without one")
    if min(args.max_images, args.max_image_bytes, args.max_image_pixels) < 1:
        raise OpenflashError("--max-images, --max-image-bytes and --max-image-pixels must be >= 1")
    local_images = Path(args.allowed_local_image_dir) if args.allowed_local_image_dir else None
    if local_images is not None and not local_images.is_dir():
        raise OpenflashError(f"--allowed-local-image-dir {local_images}: not a folder")
    engine_config = EngineConfig.from_args(args)  # checked before the model loads
    placement, group = _placed(args)
    loaded = open_model(args.model, args.tokenizer, args.numerics, placement, verify=args.verify, expert_group=group)
    name = args.model if args.model in PRESETS else Path(args.model).resolve().name
    if args.lora:
        loaded.load_adapters(lora_modules(args.lora, name), verify=args.verify)
        log.info("LoRA adapters: %s (a request's \"model\" picks one)", ", ".join(loaded.adapter_names))
    model, tokenizer, note = loaded.model, loaded.tokenizer, loaded.note
    if args.model in PRESETS:
        log.warning("serving preset %r with RANDOM weights: outputs are noise (%s)", args.model, note)
    else:
        log.info("loaded %s: %s", args.model, note)
    engram = loaded.memory.placement
    if engram == "device":  # rows already on the device: nothing to prefetch
        engine_config = replace(engine_config, engram_speculate=0)
    engine = LLMEngine(loaded, engine_config, None if group is None else Lockstep(group.rank, group.world_size))
    if group is not None and group.rank != 0:  # rank 0 serves HTTP; this rank runs the same engine steps
        log.info("rank %d of %d: stepping with rank 0's engine (%s)", group.rank, group.world_size, note)
        engine.follow()
        log.info("rank %d: rank 0 stopped the group", group.rank)
        loaded.close()
        return 0
    fmt = chat_format(tokenizer, model.cfg.bos_token_id, model.cfg.eos_token_id, args.chat_template)
    if args.thinking and fmt.name != "deepseek-v4.1":
        raise OpenflashError(f"--thinking needs the deepseek-v4.1 chat template; this model's is {fmt.name!r}")
    log.info("chat template: %s%s", fmt.name, " (thinking by default)" if args.thinking else "")
    config = ServerConfig(model_name=name, chat_format=fmt, thinking_default=args.thinking,
                          max_request_bytes=args.max_request_bytes, body_timeout=args.body_timeout, api_key=api_key,
                          images=ImagePolicy(ImageLimits(args.max_image_bytes, args.max_image_pixels), args.max_images,
                                             local_images))
    app = build_app(engine, tokenizer, config)
    stats = engine.stats()
    log.info("model %r: max batch %d, context %d, prefill %s, global cache %.0f B/token (%s), Engram %s",
             name, args.max_batch, args.max_context, args.prefill_mode, stats["global_cache_bytes_per_token"],
             stats["kv_storage"], engram)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=int(config.drain_timeout))
    loaded.close()
    return 0
