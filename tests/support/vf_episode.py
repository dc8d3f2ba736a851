"""One verifiers 0.4 episode, run offline against an engine's HTTP server with `TrainClient`.

verifiers loads a taskset and a harness by plugin id: it imports the module the id names and
takes the ``Taskset`` / ``Harness`` subclass from its ``__all__``. This module is both: a taskset
of one chat task whose reward is computed from the trace, and a harness that plays the seat in
this process (``Harness.launch``'s documented in-process form: one chat completion sent to the
rollout's interception endpoint with the rollout's secret, then a synthetic success). No
sandbox, no uv-built chat program (the bundled ``null`` harness builds one with ``uv sync``,
which needs the network), no hub, no Prime endpoint.

``run_episode`` drives the real machinery: ``load_environment`` (-> ``SingleAgentEnv``), its
``serving()`` (verifiers' interception server on 127.0.0.1), one ``run_slot`` on the subprocess
runtime; the interception hands the harness's request to ``TrainClient``, which renders the
messages with a ``renderers`` renderer built from a local tokenizer directory and POSTs token ids
to ``/inference/v1/generate``. Kept quiet and offline: the client's key comes from a variable of
our own (``PRIME_API_KEY`` would make verifiers read ``~/.prime/config.json``), the base URL is
given, the renderer config is explicit (auto-resolution probes the Hub for unknown names), the
runtime's scratch directories go under ``cache_dir``, and verifiers' loggers are raised to
WARNING. The id is registered in ``sys.modules`` under a top-level name for the run only:
verifiers probes ``verifiers.v1.tasksets.<id>`` first, which a dotted id breaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI

PLUGIN_ID = "jaxrl-vf-episode"
PLUGIN_MODULE = "jaxrl_vf_episode"  # what verifiers imports for PLUGIN_ID
PROMPT = "hello world, reverse the text please"
SYSTEM_PROMPT = "Reverse in <answer></answer>:"


class EpisodeTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def sampled_tokens(self, trace) -> float:
        """The number of model-sampled tokens on the trace's branch: it proves the reward
        ran over the trajectory the engine produced (the test compares it to the engine's)."""
        (branch,) = trace.branches
        return float(sum(branch.sampled_mask))


class EpisodeTaskset(vf.Taskset[EpisodeTask, vf.TasksetConfig]):
    def load(self) -> Iterator[EpisodeTask]:
        data = vf.TaskData(name="reverse", prompt=PROMPT, system_prompt=SYSTEM_PROMPT)
        yield EpisodeTask(data, self.config.task)


class ChatOnceConfig(vf.HarnessConfig):
    pass


class ChatOnceHarness(vf.Harness[ChatOnceConfig]):
    """One chat turn, in process, through the rollout's interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_: Any):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        http = httpx.AsyncClient(trust_env=False)  # loopback only, whatever the proxy settings
        async with AsyncOpenAI(
            base_url=endpoint, api_key=secret, max_retries=0, http_client=http
        ) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["ChatOnceConfig", "ChatOnceHarness", "EpisodeTask", "EpisodeTaskset"]


@dataclass(frozen=True)
class EpisodeRun:
    episode: Any  # verifiers.v1.Episode
    renderer: Any  # the renderers.Renderer TrainClient rendered with


@contextlib.contextmanager
def _registered_and_quiet(cache_dir: Path) -> Iterator[None]:
    from verifiers.v1.runtimes import subprocess as vf_subprocess

    loggers = [logging.getLogger(n) for n in ("verifiers", "renderers", "httpx", "aiohttp")]
    levels = [lg.level for lg in loggers]
    saved_cache = vf_subprocess.CACHE_DIR
    saved_module = sys.modules.get(PLUGIN_MODULE)
    sys.modules[PLUGIN_MODULE] = sys.modules[__name__]
    vf_subprocess.CACHE_DIR = cache_dir
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        vf_subprocess.CACHE_DIR = saved_cache
        if saved_module is None:
            sys.modules.pop(PLUGIN_MODULE, None)
        else:
            sys.modules[PLUGIN_MODULE] = saved_module


def run_episode(
    base_url: str, model: str, tokenizer_dir: Path, max_tokens: int, cache_dir: Path
) -> EpisodeRun:
    """One greedy episode of the taskset's one task, ``TrainClient`` pointed at ``base_url``
    (the server root: the client appends ``/v1`` and verifiers' renderer client strips it to
    reach ``/inference/v1/generate``)."""
    from renderers import DefaultRendererConfig
    from verifiers.v1.clients.train import ElasticRendererPool
    from verifiers.v1.utils.loaders import load_environment

    with _registered_and_quiet(cache_dir):
        env = load_environment(
            vf.SingleAgentEnvConfig(
                taskset=vf.TasksetConfig(id=PLUGIN_ID),
                agent=vf.AgentConfig(runtime=vf.SubprocessConfig()),
            )
        )
        client = vf.TrainClientConfig(
            base_url=f"{base_url}/v1",
            api_key_var="JAXRL_ORCH_TEST_ENGINE_KEY",
            renderer=DefaultRendererConfig(),
            renderer_model_name=str(tokenizer_dir),
        )
        ctx = vf.ModelContext(
            model=model,
            client=client,
            sampling=vf.SamplingConfig(temperature=0.0, max_tokens=max_tokens),
        )
        (task,) = list(env.taskset)

        async def main():
            async with env.serving():
                (slot,) = env.slots(task)
                episode = await env.run_slot(slot, ctx)
            pool = ElasticRendererPool(
                str(tokenizer_dir), client.renderer, multiplex=client.multiplex
            )
            async with pool.acquire() as renderer_slot:
                return EpisodeRun(episode, renderer_slot.renderer)

        return asyncio.run(main())
