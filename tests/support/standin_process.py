"""A stand-in engine replica in its own process, to be stopped (SIGSTOP) and resumed (SIGCONT).

``python -m support.standin_process --answer N [--hold]`` (``tests/`` on ``PYTHONPATH``) serves
what a replica serves (``distributed.replica``: a ``ReplicaHost`` behind ``make_app`` +
``HttpServer`` on a free loopback port, ``serve_until_signal``), with no JAX engine: it starts
without weights, and each ``POST /update_weights`` "pulls" at once and stamps the version, so a
test sees versions move without a transfer server. Its driver (``TimedDriver``) answers every
sample at once with the one token ``N`` stamped with the version it holds; with ``--hold`` it
answers none (they stay in flight until their client goes away, which cancels them). Each
answered sample counts as one second of engine time (``/health``'s ``engine_s``), so a test
counts a replica's answers without a hook into the process. Prints ``READY <url> <pid>``.
``--delay S`` answers each sample S seconds after it came, ``--pull-delay S`` takes S seconds
to "pull" each offer; ``--model`` names the model it
serves; ``--key-file`` makes it require that key; ``--run HOST:PORT`` links it to a run's weight
server as a replica of a run is (``replica.RunLink``: SIGTERM asks the run to drain it first),
and ``--join`` also has it ask the run to admit it once it is up.

``StandInProcess(answer, hold)`` starts one from a test: ``url``, ``pid``, ``pause()``
(SIGSTOP), ``resume()`` (SIGCONT) and ``kill()``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import queue
import signal
import subprocess
import threading
import time

from jaxrl_orch.types import Completion
from support.checkout import helper_cmd, subprocess_env
from support.standin_replica import StandInEngine


class TimedDriver:
    """The driver a ``StandInHost`` builds at its first update (see the module docstring)."""

    paused = False

    def __init__(self, version: int, answer: int, hold: bool, delay_s: float = 0.0) -> None:
        self.version, self.answer, self.hold, self.delay_s = version, answer, hold, delay_s
        self.answered = 0

    def submit(self, prompt_ids, samplings, on_token=None):
        futures = [concurrent.futures.Future() for _ in samplings]
        if not self.hold:
            done = Completion([self.answer], [-1.0], [self.version], "length")
            for f in futures:
                if self.delay_s:
                    threading.Timer(self.delay_s, f.set_result, (done,)).start()
                else:
                    f.set_result(done)
            self.answered += len(futures)
        return futures

    def swap_params(self, params, version):
        self.version = version
        done = concurrent.futures.Future()
        done.set_result(version)
        return done

    def gauges(self):
        return {"inference/queue_depth": 0.0, "inference/decode_s": float(self.answered)}

    def stop(self):
        pass


def _host(args: argparse.Namespace):
    from jaxrl_orch.distributed.replica import ReplicaHost

    class StandInHost(ReplicaHost):
        def _start_driver(self, params, version):
            return TimedDriver(version, args.answer, args.hold, args.delay)

    def source(uuid, layout, timeout_s):  # the offer "arrives" (at once, or after the delay)
        time.sleep(args.pull_delay)
        return {"uuid": uuid}

    return StandInHost(StandInEngine(), replica=args.answer, model=args.model, source=source)


def main() -> None:
    from jaxrl_orch.distributed.addresses import read_api_key
    from jaxrl_orch.distributed.admission import JoinRefused
    from jaxrl_orch.distributed.launch_local import free_ports
    from jaxrl_orch.distributed.replica import RunLink, serve_until_signal
    from jaxrl_orch.serving.app import make_app
    from jaxrl_orch.serving.runner import HttpServer

    parser = argparse.ArgumentParser()
    parser.add_argument("--answer", type=int, required=True)
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--pull-delay", type=float, default=0.0)
    parser.add_argument("--model", default="stand-in")
    parser.add_argument("--key-file", default=None)
    parser.add_argument("--run", default=None)
    parser.add_argument("--join", action="store_true")
    args = parser.parse_args()
    host = _host(args)
    key = read_api_key(args.key_file)
    # A replica's URL is known before it serves (the pool or the join request names it).
    port = free_ports(1)[0]
    server = HttpServer(make_app(host, api_key=key), port=port, grace_s=0.2, api_key=key)
    link = None
    if args.run is not None:
        url = f"http://127.0.0.1:{port}"
        link = RunLink(args.run, url, key, join=args.join, drain_s=30.0)
    ready = lambda url: print(f"READY {url} {os.getpid()}", flush=True)  # noqa: E731
    try:
        asyncio.run(serve_until_signal(host, server, on_up=ready, link=link))
    except JoinRefused as exc:
        print(f"REFUSED {exc}", flush=True)
        raise SystemExit(3) from None


class StandInProcess:
    """One ``python -m support.standin_process`` (see the module docstring); ``wait_ready()``
    returns once it answers, so several can start side by side."""

    def __init__(self, answer: int, hold: bool = False, *flags: str) -> None:
        cmd = helper_cmd(
            "standin_process", "--answer", str(answer), *(["--hold"] if hold else []), *flags
        )
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=subprocess_env(),
        )
        self.lines: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url: str | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_ready(self, timeout_s: float = 60.0) -> StandInProcess:
        while self.url is None:
            try:
                line = self.lines.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"stand-in replica silent for {timeout_s} s") from None
            if line.startswith("READY "):
                self.url = line.split()[1]
            assert self.proc.poll() is None, f"stand-in replica exited ({self.proc.returncode})"
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def said(self) -> str:
        """What it printed since ``wait_ready``, once it has exited (or been killed)."""
        self._reader.join(10.0)
        out = []
        while not self.lines.empty():
            out.append(self.lines.get())
        return "".join(out)

    def kill(self) -> None:
        """SIGKILL (a stopped process cannot handle SIGTERM) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    main()
