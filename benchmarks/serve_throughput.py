"""Generated tokens/s over HTTP vs in process: what the engine's HTTP surface costs.

Both sides drive the same ``InferenceDriver`` (one engine, one set of weights, warmed up) with
the same workload: ``--clients`` concurrent clients (default 64), each sending its share of
``--requests`` prompts one after another (a new one as soon as its last finished), every
request a seeded sample of ``--max-tokens`` tokens with no stop ids, so both sides generate
exactly the same tokens.

- in process: each client is an asyncio task awaiting ``EngineClient.generate`` (what the
  orchestrator's dispatcher does with the in-process engine);
- HTTP: each client is an asyncio task posting to ``POST /inference/v1/generate`` of an
  ``EngineHost`` + ``make_app`` served by uvicorn on loopback (``HttpServer``, its own thread and
  event loop, as ``python -m jaxrl_orch.serve`` and the train command's ``Engine.serve_port``
  run it), JSON in and out, log-probs and versions included. The clients run in a process of
  their own, as real clients do, over one ``aiohttp`` session (httpx's connection pool costs
  more CPU per request than the server does: in one process it measured the client).

The two sides alternate ``--repeats`` times (default 3) and the tokens and seconds are summed;
``ratio`` = HTTP tokens/s over in-process tokens/s (the target: >= 0.9). The token ids of both
sides are compared: a mismatch fails the run (the surface must not change what is generated).
Prints one JSON line with ``--json``. Usage:
    python benchmarks/serve_throughput.py --json
    python benchmarks/serve_throughput.py --json --model small-byte --slots 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time

import aiohttp
import numpy as np

from jaxrl_orch.inference.client import EngineClient
from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.transformer import get_config
from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer
from jaxrl_orch.types import SamplingParams

MODEL_NAME = "bench"


def workload(requests: int, max_tokens: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, seed) per request: prompts of 16..64 byte ids."""
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(0, 256, size=int(rng.integers(16, 65))).tolist(), i) for i in range(requests)
    ]


async def run_clients(n: int, work: list, one) -> tuple[dict[int, list[int]], float]:
    """Run ``work`` through ``n`` concurrent clients; ``one(prompt, seed) -> token ids``."""
    queue = list(enumerate(work))
    out: dict[int, list[int]] = {}

    async def client() -> None:
        while queue:
            i, (prompt, seed) = queue.pop()
            out[i] = await one(prompt, seed)

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(n)))
    return out, time.perf_counter() - t0


def in_process(driver: InferenceDriver, work: list, clients: int, max_tokens: int):
    engine_client = EngineClient(driver)

    async def one(prompt: list[int], seed: int) -> list[int]:
        sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed)
        return (await engine_client.generate(prompt, sp)).token_ids

    return asyncio.run(run_clients(clients, work, one))


def over_http(url: str, work: list, clients: int, max_tokens: int):
    """The HTTP clients, in a process of their own (as an eval harness or an agent framework
    would be): the load they generate does not take the server process's GIL."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_http_clients, (url, work, clients, max_tokens))


def _http_clients(url: str, work: list, clients: int, max_tokens: int):
    async def main():
        connector = aiohttp.TCPConnector(limit=clients)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:

            async def one(prompt: list[int], seed: int) -> list[int]:
                body = {
                    "model": MODEL_NAME,
                    "token_ids": prompt,
                    "sampling_params": {
                        "temperature": 1.0,
                        "max_tokens": max_tokens,
                        "seed": seed,
                        "logprobs": 1,
                    },
                }
                async with http.post("/inference/v1/generate", json=body) as r:
                    r.raise_for_status()
                    return (await r.json())["choices"][0]["token_ids"]

            return await run_clients(clients, work, one)

    return asyncio.run(main())


def alternate(repeats: int, in_proc, http, what: str) -> tuple[dict[str, float], list[float]]:
    """Run the in-process side and the HTTP side ``repeats`` times each, alternating; each side
    returns ``({request: items}, seconds)`` and both must give the same items (``what``: their
    name, for the failure). Returns items/s per side (summed over the repeats) and the
    per-repeat ratios HTTP / in process."""
    sums = {"in_process": [0, 0.0], "http": [0, 0.0]}
    per_repeat = []
    for _ in range(repeats):
        ref, s_in = in_proc()
        got, s_http = http()
        if got != ref:
            raise SystemExit(f"HTTP and in-process {what} differ for the same requests")
        items = sum(len(v) for v in ref.values())
        for side, seconds in (("in_process", s_in), ("http", s_http)):
            sums[side][0] += items
            sums[side][1] += seconds
        per_repeat.append(round(s_in / s_http, 3))
    return {k: n / t for k, (n, t) in sums.items()}, per_repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--model", default="tiny-byte", help="model preset")
    ap.add_argument("--slots", type=int, default=64, help="decode slots")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=1024, help="requests per side and repeat")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="alternate the two sides N times")
    args = ap.parse_args()
    limits = EngineLimits(
        max_concurrent_decodes=args.slots,
        max_target_length=64 + args.max_tokens,
        max_prefill_length=64,
        steps_per_call=4,
    )
    engine = DecodeEngine(get_config(args.model), limits=limits)
    driver = InferenceDriver(engine, engine.load_params(seed=0), 0, prefix_cache_size=0)
    driver.warm_up()
    driver.start()
    server = HttpServer(make_app(EngineHost(engine, model=MODEL_NAME, driver=driver)))
    server.start_in_thread()
    work = workload(args.requests, args.max_tokens)
    try:
        rate, per_repeat = alternate(
            args.repeats,
            lambda: in_process(driver, work, args.clients, args.max_tokens),
            lambda: over_http(server.url, work, args.clients, args.max_tokens),
            "token ids",
        )
    finally:
        server.stop()
        driver.stop()
    result = {
        "benchmark": "serve_throughput",
        "model": args.model,
        "slots": args.slots,
        "clients": args.clients,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "in_process_tokens_per_s": round(rate["in_process"], 1),
        "http_tokens_per_s": round(rate["http"], 1),
        "ratio": round(rate["http"] / rate["in_process"], 3),
        "ratio_per_repeat": per_repeat,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
