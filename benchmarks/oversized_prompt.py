"""How a server answers prompts that cannot fit its context: time to the refusal and the process's memory.

    python benchmarks/oversized_prompt.py [--mib 30] [--context 4096]

Serves the `tiny` preset (uvicorn on a free loopback port, in this process), sends one prompt of `--mib` MiB and
then four of a third of that at once, and prints each answer's status and time and the process's RSS before,
after and at its peak (the client's own strings are in the same process, so these bound the server's from above).
Writes benchmarks/results/oversized_prompt.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
import uvicorn

from openflash.chat import chat_format
from openflash.engine.engine import EngineConfig, LLMEngine
from openflash.runtime.open import open_model
from openflash.serve.app import ServerConfig, build_app


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=30, help="size of the one large prompt")
    parser.add_argument("--context", type=int, default=4096, help="the server's max context")
    args = parser.parse_args()
    if args.mib < 1 or args.context < 2:
        parser.error("--mib must be >= 1 and --context >= 2")
    torch.set_num_threads(1)
    loaded = open_model("tiny", numerics="plain")
    engine = LLMEngine(loaded, EngineConfig(max_batch=4, max_context=args.context))
    app = build_app(engine, loaded.tokenizer, ServerConfig("tiny", chat_format(loaded.tokenizer, 0, 1)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        httpx.post(url, json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=60)
        before = rss_mib()
        line = "def f(x):\n    return x\n"
        prompt = line * ((args.mib << 20) // len(line))
        start = time.perf_counter()
        one = httpx.post(url, json={"model": "tiny", "prompt": prompt}, timeout=600)
        one_s = time.perf_counter() - start
        body = {"model": "tiny", "prompt": prompt[: len(prompt) // 3]}
        start = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            four = list(pool.map(lambda _: httpx.post(url, json=body, timeout=600).status_code, range(4)))
        four_s = time.perf_counter() - start
        del prompt, body["prompt"]
        time.sleep(1)
        result = {"mib": args.mib, "context": args.context, "one_status": one.status_code, "one_seconds": one_s,
                  "four_statuses": four, "four_seconds": four_s, "rss_before_mib": before, "rss_after_mib": rss_mib(),
                  "rss_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "message": one.json()["error"]["message"] if one.status_code != 200 else None}
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    print(f"{args.mib} MiB prompt: {result['one_status']} in {one_s:.2f} s; four of {args.mib / 3:.0f} MiB at once: "
          f"{four} in {four_s:.2f} s; RSS {before:.0f} MiB before, {result['rss_after_mib']:.0f} after, "
          f"{result['rss_peak_mib']:.0f} peak (client included)")
    out = Path(__file__).parent / "results" / "oversized_prompt.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
