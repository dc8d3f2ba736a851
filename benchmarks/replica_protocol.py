"""Benchmark: per-request overhead of the replicas' HTTP protocol on loopback, client by client.

A server process (FastAPI + uvicorn, as a replica serves) fronts a trivial handler on
``POST /inference/v1/generate`` (no engine: every request gets the same completion of
``--tokens`` tokens, in that route's answer shape); this process is the client, with a fixed
number of requests in flight (each worker sends its next request as soon as its last came
back). Sides (``--sides``), each one client object for all requests:
- ``aiohttp``: ``aiohttp.ClientSession``, the pool's client (``distributed.replica_client``);
- ``httpx``: ``httpx.AsyncClient``, the client the pool does not use, for the comparison.
Both carry the same JSON bodies (a ``--prompt_len``-token request, the completion back).

Two scenarios, sides alternating ``--repeats`` times, each side's best repeat kept:
- ``saturated``: the handler answers at once, ``--concurrency`` in flight (default 64):
  requests/s, mean latency and the client's CPU ms per request; ``ratio`` is httpx's
  requests/s over aiohttp's.
- ``pool``: the pool's real load. A replica with ``--slots`` slots, a decode step of
  ``--decode_step_ms`` and requests of ``--max_tokens`` tokens holds every request for
  ``max_tokens * step`` and finishes ``slots / (max_tokens * step)`` requests a second; the
  handler sleeps that long, ``--slots`` in flight. Reported: requests/s (the bound above when
  the client keeps up), mean latency over the hold, and the client's CPU ms per request
  (``time.process_time``: what each request costs the orchestrator's event loop) and its share
  of one core.

How to run
    python benchmarks/replica_protocol.py --json
    python benchmarks/replica_protocol.py --json --sides aiohttp --slots 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from fastapi import FastAPI, Request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUTE = "/inference/v1/generate"


def _bodies(prompt_len: int, tokens: int) -> tuple[dict, dict]:
    request = {
        "model": "bench",
        "token_ids": list(range(100, 100 + prompt_len)),
        "sampling_params": {"temperature": 1.0, "max_tokens": tokens, "seed": 7, "logprobs": 1},
    }
    ids = list(range(200, 200 + tokens))
    content = [
        {"token": f"token_id:{t}", "logprob": -0.25, "bytes": None, "top_logprobs": []} for t in ids
    ]
    choice = {
        "index": 0,
        "token_ids": ids,
        "logprobs": {"content": content},
        "finish_reason": "length",
        "policy_versions": [3] * tokens,
    }
    return request, {"request_id": "gen-0", "choices": [choice], "prompt_logprobs": None}


def _serve_http(port: int, response: dict, hold_s: float) -> None:
    import uvicorn

    app = FastAPI()

    @app.post(ROUTE)
    async def generate(request: Request) -> dict:
        await request.json()  # parse the body, as a real handler does
        if hold_s:
            await asyncio.sleep(hold_s)
        return response

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"the server did not listen on port {port} within {timeout_s} s")


async def _drive(call: Any, n: int, concurrency: int) -> dict[str, float]:
    """``n`` calls with ``concurrency`` in flight: wall seconds, mean latency, client CPU."""
    latencies: list[float] = []
    left = iter(range(n))

    async def worker() -> None:
        for _ in left:
            t = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t)

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"secs": secs, "latency_s": sum(latencies) / n, "cpu_s": cpu}


async def _client(kind: str, port: int, request: dict, tokens: int, limit: int) -> tuple:
    """(call, close) of one client of ``kind``."""
    url = f"http://127.0.0.1:{port}{ROUTE}"
    if kind == "httpx":
        import httpx

        limits = httpx.Limits(max_connections=2 * limit, max_keepalive_connections=None)
        client = httpx.AsyncClient(limits=limits, timeout=600.0)

        async def call() -> None:
            r = await client.post(url, json=request)
            r.raise_for_status()
            assert len(r.json()["choices"][0]["token_ids"]) == tokens

        return call, client.aclose
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=2 * limit))

    async def call() -> None:
        async with session.post(url, json=request) as r:
            r.raise_for_status()
            assert len((await r.json())["choices"][0]["token_ids"]) == tokens

    return call, session.close


def _side(kind: str, args: argparse.Namespace, hold_s: float, n: int, conc: int) -> dict:
    port = _free_port()
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", "--port", str(port)]
    cmd += ["--tokens", str(args.tokens), "--prompt_len", str(args.prompt_len)]
    cmd += ["--hold_s", str(hold_s)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    request, _ = _bodies(args.prompt_len, args.tokens)

    async def run() -> dict:
        call, close = await _client(kind, port, request, args.tokens, conc)
        try:
            await _drive(call, conc, conc)  # every connection opened, the server warm
            return await _drive(call, n, conc)
        finally:
            await close()

    try:
        _wait_port(port, proc)
        return asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(10)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--sides", default="aiohttp,httpx", help="clients to measure")
    p.add_argument("--concurrency", type=int, default=64, help="in flight, saturated scenario")
    p.add_argument("--requests", type=int, default=2000, help="requests, saturated scenario")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16, help="tokens in the fixed completion")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--slots", type=int, default=64, help="a replica's slots (pool scenario)")
    p.add_argument("--max_tokens", type=int, default=128, help="tokens a request decodes")
    p.add_argument("--decode_step_ms", type=float, default=4.0, help="one decode step")
    p.add_argument("--pool_rounds", type=int, default=4, help="requests per slot, pool scenario")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--hold_s", type=float, default=0.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _best(args: argparse.Namespace, sides: list[str], hold_s: float, n: int, conc: int) -> dict:
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for kind in sides:
            got = _side(kind, args, hold_s, n, conc)
            if kind not in best or got["secs"] < best[kind]["secs"]:
                best[kind] = got
    return best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.serve:
        _, response = _bodies(args.prompt_len, args.tokens)
        _serve_http(args.port, response, args.hold_s)
        return {}
    sides = [s for s in args.sides.split(",") if s]
    hold_s = args.max_tokens * args.decode_step_ms / 1000
    out: dict[str, Any] = {"concurrency": args.concurrency, "completion_tokens": args.tokens}
    for kind, r in _best(args, sides, 0.0, args.requests, args.concurrency).items():
        out[f"saturated_{kind}_requests_per_s"] = round(args.requests / r["secs"], 1)
        out[f"saturated_{kind}_mean_latency_ms"] = round(r["latency_s"] * 1000, 3)
        out[f"saturated_{kind}_client_cpu_ms_per_request"] = round(
            r["cpu_s"] / args.requests * 1e3, 3
        )
    if {"httpx", "aiohttp"} <= set(sides):
        rps = out["saturated_httpx_requests_per_s"]
        out["ratio"] = round(rps / out["saturated_aiohttp_requests_per_s"], 3)
    n = args.slots * args.pool_rounds
    out["pool_slots"], out["pool_hold_ms"] = args.slots, round(hold_s * 1000, 1)
    out["pool_bound_requests_per_s"] = round(args.slots / hold_s, 1)
    for kind, r in _best(args, sides, hold_s, n, args.slots).items():
        out[f"pool_{kind}_requests_per_s"] = round(n / r["secs"], 1)
        out[f"pool_{kind}_mean_latency_ms"] = round(r["latency_s"] * 1000, 1)
        out[f"pool_{kind}_client_cpu_ms_per_request"] = round(r["cpu_s"] / n * 1000, 3)
        out[f"pool_{kind}_client_core_share"] = round(r["cpu_s"] / r["secs"], 3)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:44s} {v}")
    return out


if __name__ == "__main__":
    main()
