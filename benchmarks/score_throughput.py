"""Prompt tokens scored per second over HTTP vs in process: what scoring through the API costs.

An eval harness scores a multiple-choice answer by sending ``{"echo": true, "max_tokens": 0,
"logprobs": 1}`` to ``/v1/completions`` and reading the prompt's log-probs. Both sides here score
the same prompts on one ``InferenceDriver`` (one engine, one set of weights, its scoring
program compiled before the clock starts):

- in process: ``--clients`` concurrent asyncio tasks awaiting ``driver.score(prompt, 1)``;
- HTTP: the same number of clients, in a process of their own over one ``aiohttp`` session
  (as in ``serve_throughput.py``), posting lm-evaluation-harness's payload to
  ``POST /v1/completions`` of an ``EngineHost`` served by uvicorn on loopback.

A prompt of L tokens scores L - 1 of them (the first has nothing before it). The two sides
alternate ``--repeats`` times; ``ratio`` = HTTP scored tokens/s over in-process (the goal: >=
0.8). The log-probs of both sides are compared: a mismatch fails the run (the surface must not
change what is scored). One JSON line with ``--json``:
    python benchmarks/score_throughput.py --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing

import aiohttp
from serve_throughput import MODEL_NAME, alternate, run_clients, workload

from jaxrl_orch.inference.driver import InferenceDriver
from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.tokenizer import ByteTokenizer
from jaxrl_orch.models.transformer import get_config
from jaxrl_orch.serving.app import make_app
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.runner import HttpServer


def in_process(driver: InferenceDriver, work: list, clients: int):
    async def one(prompt: list[int], _seed: int) -> list[float]:
        scores = await asyncio.wrap_future(driver.score(prompt, 1))
        return [float(x) for x in scores.logprobs[1:]]

    return asyncio.run(run_clients(clients, work, one))


def over_http(url: str, work: list, clients: int):
    """The HTTP clients, in a process of their own (as an eval harness would be)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(_http_clients, (url, work, clients))


def _http_clients(url: str, work: list, clients: int):
    async def main():
        connector = aiohttp.TCPConnector(limit=clients)
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:

            async def one(prompt: list[int], _seed: int) -> list[float]:
                body = {
                    "model": MODEL_NAME,
                    "prompt": prompt,
                    "echo": True,
                    "max_tokens": 0,
                    "logprobs": 1,
                    "temperature": 0.0,
                }
                async with http.post("/v1/completions", json=body) as r:
                    r.raise_for_status()
                    logprobs = (await r.json())["choices"][0]["logprobs"]["token_logprobs"]
                    return logprobs[1:]

            return await run_clients(clients, work, one)

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON result line")
    ap.add_argument("--model", default="tiny-byte", help="model preset")
    ap.add_argument("--clients", type=int, default=64, help="concurrent clients")
    ap.add_argument("--requests", type=int, default=1024, help="prompts per side and repeat")
    ap.add_argument("--repeats", type=int, default=3, help="alternate the two sides N times")
    args = ap.parse_args()
    limits = EngineLimits(max_concurrent_decodes=8, max_target_length=128, max_prefill_length=64)
    engine = DecodeEngine(get_config(args.model), limits=limits)
    driver = InferenceDriver(engine, engine.load_params(seed=0), 0, prefix_cache_size=0)
    driver.start()
    host = EngineHost(engine, model=MODEL_NAME, driver=driver, tokenizer=ByteTokenizer())
    server = HttpServer(make_app(host))
    server.start_in_thread()
    work = workload(args.requests, max_tokens=0)
    in_process(driver, work[:64], args.clients)  # every prompt bucket's scoring program, compiled
    try:
        rate, per_repeat = alternate(
            args.repeats,
            lambda: in_process(driver, work, args.clients),
            lambda: over_http(server.url, work, args.clients),
            "prompt log-probs",
        )
    finally:
        server.stop()
        driver.stop()
    result = {
        "benchmark": "score_throughput",
        "model": args.model,
        "clients": args.clients,
        "requests": args.requests,
        "in_process_scored_tokens_per_s": round(rate["in_process"], 1),
        "http_scored_tokens_per_s": round(rate["http"], 1),
        "ratio": round(rate["http"] / rate["in_process"], 3),
        "ratio_per_repeat": per_repeat,
    }
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
