"""VerifiersEnv: a verifiers 0.4 environment as an environment of the loop (docs/design.md
section 10; docs/environments.md).

What it owns
- Loading: the dict a verifiers user writes for ``SingleAgentEnvConfig`` (``Verifiers.env``, the
  gin macro ``VERIFIERS_ENV``) through verifiers' own ``load_environment``. An agent without a
  runtime runs in the ``subprocess`` runtime (verifiers' default is its hosted one). The bundled
  example ids (``EXAMPLES``) resolve to modules of ``jaxrl_orch.examples``.
- Data: the taskset's tasks are the examples, ``{"split", "task"}`` by position. A taskset whose
  config has a ``split`` field is loaded once per split (``"train"`` / ``"eval"``); any other
  holds out every ``holdout_every``-th task.
- Serving: verifiers' ``env.serving()`` (its interception server), the ``EngineBridge`` and the
  loop's loopback client for in-process harnesses (``envs.vf.loopback``) open once, on the
  first rollout, in the loop that runs it, and close in ``aclose()``, which the stages call on
  every exit path (end, drain, crash).
- ``run``: one episode of the example's task through ``run_slot``, its model calls sent by
  verifiers' ``TrainClient`` (renderer from ``tokenizer_dir``) to the bridge, which answers with
  the ``InferenceClient`` the dispatcher handed this rollout; then ``traces.episode_rollout``.

Invariants: nothing of verifiers is imported unless this env is chosen (the ``verifiers``
extra); a rollout cancelled by the dispatcher (drop policy, timeout, shutdown) cancels its
episode and its engine requests; an episode that failed raises, so the dispatcher makes it an
error rollout, counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from jaxrl_orch.envs.base import EnvTokenizer, stop_ids_of, with_stop_ids
from jaxrl_orch.envs.vf import loopback
from jaxrl_orch.envs.vf.bridge import EngineBridge, check_sampling_keys
from jaxrl_orch.envs.vf.traces import episode_rollout
from jaxrl_orch.paths import as_path, is_url
from jaxrl_orch.types import InferenceClient, Rollout, SamplingParams

EXAMPLES = {
    "jaxrl-reverse-text": "jaxrl_orch.examples.vf_reverse_text",
    "jaxrl-two-turn": "jaxrl_orch.examples.vf_two_turn",
    "jaxrl-tool-call": "jaxrl_orch.examples.vf_tool_call",
}
KEY_VAR = "JAXRL_ORCH_BRIDGE_KEY"  # the bridge takes no key; a name verifiers reads no config for
QUIET = ("verifiers", "renderers", "httpx", "aiohttp.access")
# verifiers' interception server keeps one TrainClient per distinct client config, and its
# httpx pool holds a connection per request in flight; httpcore's bookkeeping on every request
# and reply scans each idle connection against all the others (quadratic in the pool). Rollouts
# spread over this many configs, which differ only in a header the bridge ignores, keep each
# pool a quarter of the run's concurrency (a sixteenth of the quadratic cost). Not more: each
# client loads a verified TLS context when it is built, tens of ms on the loop per opening.
CLIENT_POOLS = 4
POOL_HEADER = "X-Jaxrl-Client-Pool"


def register_examples(taskset_id: str) -> None:
    """Make a bundled example importable under the top-level name verifiers derives from its
    id (verifiers imports ``<id with - as _>``, which a dotted module path cannot be)."""
    module = EXAMPLES.get(taskset_id)
    if module is not None:
        sys.modules.setdefault(taskset_id.replace("-", "_"), importlib.import_module(module))


def env_config(spec: Mapping[str, Any]) -> Any:
    """``spec`` as verifiers' ``SingleAgentEnvConfig``, on the subprocess runtime by default."""
    import verifiers.v1 as vf

    if not isinstance(spec, Mapping) or not isinstance(spec.get("taskset"), Mapping):
        raise ValueError(
            f"Verifiers.env must be a SingleAgentEnvConfig dict with a 'taskset' dict, e.g. "
            f"{{'taskset': {{'id': 'jaxrl-reverse-text'}}}}; got {spec!r}"
        )
    spec = dict(spec)
    agent = dict(spec.get("agent") or {})
    agent.setdefault("runtime", {"type": "subprocess"})
    check_sampling_keys(dict(agent.get("sampling") or {}), "Verifiers.env agent.sampling")
    spec["agent"] = agent
    register_examples(str(spec["taskset"].get("id", "")))
    return vf.SingleAgentEnvConfig.model_validate(spec)


class VerifiersEnv:
    def __init__(
        self,
        tokenizer: EnvTokenizer,
        *,
        env: Mapping[str, Any],
        tokenizer_dir: str,
        renderer: str = "default",
        max_prompt_len: int = 4096,
        holdout_every: int = 10,
    ) -> None:
        from verifiers.v1.utils.loaders import load_environment

        if holdout_every < 2:
            raise ValueError(f"Verifiers.holdout_every must be >= 2, got {holdout_every!r}")
        for name in QUIET:  # a rollout logs at INFO; the run's console has its own lines
            logging.getLogger(name).setLevel(logging.WARNING)
        self.tokenizer = tokenizer
        self.tokenizer_dir = str(tokenizer_dir)
        self.vf_env = load_environment(env_config(env))
        self.name = self.vf_env.config.taskset.id or "verifiers"
        self.renderer_config = _renderer_config(renderer)
        self.holdout_every = int(holdout_every)
        self.bridge = EngineBridge(model=self.name, max_model_len=max_prompt_len)
        self._tasks = self._load()
        _preload()
        self._renderer: Any = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._opening: asyncio.Task | None = None
        self._contexts: dict[tuple[float, int, int], Any] = {}
        self._turn = 0

    # ------------------------------------------------------------------ data

    def _load(self) -> dict[str, list[Any]]:
        """The tasks of each split (see the module docstring), the taskset read once per split
        it has, or once in all."""
        from verifiers.v1.utils.loaders import load_taskset

        taskset = self.vf_env.taskset
        if not taskset.bounded:
            raise ValueError(f"taskset {self.name!r} is infinite; bound it (take / include idx)")
        if "split" in type(taskset.config).model_fields:
            return {
                split: list(load_taskset(taskset.config.model_copy(update={"split": split})))
                for split in ("train", "eval")
            }
        k = self.holdout_every
        tasks = list(taskset)
        return {
            "train": [t for i, t in enumerate(tasks) if i % k != k - 1],
            "eval": [t for i, t in enumerate(tasks) if i % k == k - 1],
        }

    def examples(self, split: str) -> list[dict[str, Any]]:
        """The examples of ``split`` (``"train"`` or ``"eval"``): one per task."""
        tasks = self._tasks[split]
        if not tasks:
            raise ValueError(f"taskset {self.name!r} has no {split} tasks")
        return [{"split": split, "task": i} for i in range(len(tasks))]

    def task(self, example: Mapping[str, Any]) -> Any:
        try:
            return self._tasks[example["split"]][example["task"]]
        except (KeyError, IndexError, TypeError):
            raise ValueError(
                f"{self.name}: example {example!r} names no task; examples come from "
                "VerifiersEnv.examples(split)"
            ) from None

    def prompt_ids(self, example: Mapping[str, Any]) -> list[int]:
        """The task's opening prompt as the renderer renders it (the prompt-length checks)."""
        data = self.task(example).data
        messages = [] if data.system_prompt is None else [_message("system", data.system_prompt)]
        prompt = data.prompt
        messages += [_message("user", prompt)] if isinstance(prompt, str) else list(prompt or [])
        return list(self.renderer().render(messages, add_generation_prompt=True).token_ids)

    def renderer(self) -> Any:
        if self._renderer is None:
            from renderers import create_renderer
            from renderers.base import load_tokenizer

            self._renderer = create_renderer(
                load_tokenizer(self.tokenizer_dir), self.renderer_config
            )
        return self._renderer

    # ------------------------------------------------------------------ serving

    async def _serving(self) -> None:
        if self._opening is None:
            self._opening = asyncio.get_running_loop().create_task(self._open())
        await asyncio.shield(self._opening)

    async def _open(self) -> None:
        stack = contextlib.AsyncExitStack()
        try:
            await stack.enter_async_context(loopback.shared_session())
            await stack.enter_async_context(self.vf_env.serving())
            await self.bridge.start()
            self._contexts.clear()  # they name the bridge's URL, a new port each opening
            stack.push_async_callback(self.bridge.stop)
            await self._learn_prompt_cap()
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack

    async def _learn_prompt_cap(self) -> None:
        """Have ``renderers`` read the bridge's prompt cap once, before any rollout. It caches
        the cap per URL under a process-wide asyncio lock; looked up by many rollouts at once,
        that lock binds to the first event loop and fails in the next one (each eval of the
        imitation control, each test). One uncontended lookup per opening never binds it."""
        import httpx
        from openai import AsyncOpenAI
        from renderers.client import _resolve_max_prompt_len

        # Plain http on loopback: no verified TLS context to load (tens of ms on the loop).
        http = httpx.AsyncClient(trust_env=False, verify=False)
        async with AsyncOpenAI(
            base_url=f"{self.bridge.base_url}/v1", api_key="-", http_client=http
        ) as c:
            await _resolve_max_prompt_len(c, self.name)

    async def aclose(self) -> None:
        """Close verifiers' serving context and the bridge (idempotent)."""
        opening, self._opening = self._opening, None
        if opening is not None and not opening.done():
            opening.cancel()
            with contextlib.suppress(BaseException):
                await opening
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    # ------------------------------------------------------------------ rollouts

    async def run(
        self,
        client: InferenceClient,
        example: dict[str, Any],
        *,
        group_id: int,
        episode_id: int,
        sampling: SamplingParams,
    ) -> Rollout:
        task = self.task(example)
        await self._serving()
        session = self.bridge.open(client, with_stop_ids(sampling, *stop_ids_of(self.tokenizer)))
        try:
            (slot,) = self.vf_env.slots(task)
            episode = await self.vf_env.run_slot(
                slot, self._context(sampling), on_trace=lambda t: self.bridge.bind(session, t.id)
            )
        finally:
            self.bridge.close(session)
        return episode_rollout(
            episode,
            session.replies,
            env=self.name,
            group_id=group_id,
            episode_id=episode_id,
            example=example,
            temperature=sampling.temperature,
        )

    def _context(self, sampling: SamplingParams) -> Any:
        """The rollout's model context: one of ``CLIENT_POOLS`` client configs in turn, built
        once per sampling and pool."""
        self._turn = (self._turn + 1) % CLIENT_POOLS
        key = (sampling.temperature, sampling.max_tokens, self._turn)
        ctx = self._contexts.get(key)
        if ctx is None:
            ctx = self._contexts[key] = self._new_context(sampling, self._turn)
        return ctx

    def _new_context(self, sampling: SamplingParams, pool: int) -> Any:
        import verifiers.v1 as vf

        client = vf.TrainClientConfig(
            base_url=f"{self.bridge.base_url}/v1",
            api_key_var=KEY_VAR,
            renderer=self.renderer_config,
            renderer_model_name=self.tokenizer_dir,
            headers={POOL_HEADER: str(pool)},
        )
        vf_sampling = vf.SamplingConfig(
            temperature=sampling.temperature, max_tokens=sampling.max_tokens
        )
        return vf.ModelContext(model=self.name, client=client, sampling=vf_sampling)


def _preload() -> None:
    """What the first rollout would otherwise do on the event loop, stalling every rollout:
    httpx imports its transport (httpcore, anyio's backend) on its first request, and the first
    trace asks for verifiers' commit (package metadata, then ``git rev-parse`` in a subprocess
    it waits for), which verifiers caches for the process."""
    import anyio._backends._asyncio  # noqa: F401
    import anyio.streams.stapled  # noqa: F401
    import httpcore  # noqa: F401
    from verifiers.v1.utils.version import verifiers_commit

    verifiers_commit()


def _renderer_config(name: str) -> Any:
    from renderers import RendererConfig

    try:
        return TypeAdapter(RendererConfig).validate_python({"name": name})
    except ValueError as exc:
        raise ValueError(f"Verifiers.renderer {name!r} is not a renderers config: {exc}") from None


def _message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def tokenizer_dir_for(spec: str, cache_dir: Path) -> str:
    """An HF tokenizer directory ``renderers`` can load for ``Model.tokenizer``: the byte
    tokenizer is written under ``cache_dir``; a tokenizer.json path names its directory."""
    from jaxrl_orch.models.byte_hf import save_byte_tokenizer

    if spec == "byte":
        return str(save_byte_tokenizer(cache_dir / "byte_tokenizer"))
    if is_url(spec):  # renderers reads a local directory: copy the tokenizer's files only
        return _local_tokenizer_copy(spec, cache_dir / "tokenizer")
    path = Path(spec)
    return str(path.parent if path.is_file() else path)


# The files of a tokenizer directory that a loader of it reads (never the weights beside them).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def _local_tokenizer_copy(url: str, dest: Path) -> str:
    """The tokenizer files of the object-storage directory ``url`` (or of the tokenizer.json it
    names) copied to ``dest``."""
    src = as_path(url)
    if src.name == "tokenizer.json":
        src = src.parent
    dest.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            (dest / name).write_bytes((src / name).read_bytes())
    return str(dest)
