"""Shared environment machinery: the token trace, the single-turn env base, the env registry.

What this module owns
- ``Trace``: the one way an environment builds a rollout's token trace. Prompt and
  environment-reply ids go in with ``loss_mask=False``, ``logprob=0.0`` and ``NO_VERSION``;
  a model turn goes in exactly as the engine returned it (its sampled ids, behavior log-probs
  and per-token versions). Model output is never re-tokenized: the ids in the trace are the
  ids the engine sampled, so the trainer scores the context the model actually saw.
- ``SingleTurnEnv``: render prompt -> ids, one ``generate`` call, decode the completion only
  to *score* it, build the ``Rollout``. Subclasses supply ``build_messages`` and ``score``.
- ``cut_fields``: a rollout any of whose completions ended short (a finish reason
  ``types.finish_trainable`` calls not whole: a pause's abort, a caller gone) is not trainable,
  and says which reason cut it. Every bundled env and the verifiers adapter end with it.
- ``check_reward``: a reward must be a finite float. NaN/inf raises ``NonFiniteReward`` (the
  dispatcher turns the exception into an error rollout, counted as ``nonfinite_rewards``)
  instead of silently poisoning the group's advantages.
- ``AtTemperature(env, t)``: a view of an env that always samples at temperature ``t`` (the
  sampled eval next to the greedy one).
- ``make_env(name, **kwargs)``: the registry of bundled environments (plus ``register_env``
  for user ones).

Invariants
- ``rollout.token_ids == prompt ids + model turn ids (+ env reply ids + model turn ids ...)``,
  and ``loss_mask``/``logprobs``/``versions`` stay aligned with it (``Rollout.validate_trace``).
- A malformed completion scores 0; it never raises. Only broken machinery raises.
- The tokenizer's stop ids (eos, plus ``stop_ids`` when it has them) are always added to the
  sampling stop ids, so a turn ends where the model ends it.

Who drives it: the orchestrator's dispatcher calls ``env.run(client, example, ...)`` once per
rollout. Environments talk to the model only through ``types.InferenceClient.generate``.
They never import the model, tokenizer or engine modules: the tokenizer is a constructor
argument (anything with ``encode``, ``decode``, ``bos_id``, ``eos_id``,
``apply_chat_template``).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxrl_orch.plugins import load_factory
from jaxrl_orch.types import (
    NO_VERSION,
    Completion,
    Environment,
    InferenceClient,
    NonFiniteReward,
    Rollout,
    SamplingParams,
    finish_trainable,
)

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class EnvTokenizer(Protocol):
    """The slice of a tokenizer an environment needs (structural; see models/tokenizer.py)."""

    bos_id: int | None
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


class RunEnv(Environment, Protocol):
    """The run's environment: what the orchestrator runs (``types.Environment``) and the ids of
    an example's prompt, which the warm-up's samples and the prompt-length checks are built
    from. What some environments add is asked for where it is used: ``prompt_text`` (a cheap
    length bound), ``examples(split)`` (their own tasks), ``reference_completion`` (warm-up
    demonstrations)."""

    def prompt_ids(self, example: dict[str, Any]) -> list[int]: ...


def check_tokenizer(tokenizer: object) -> EnvTokenizer:
    for attr in ("encode", "decode", "apply_chat_template", "eos_id", "bos_id"):
        if not hasattr(tokenizer, attr):
            raise TypeError(
                f"tokenizer {type(tokenizer).__name__} lacks {attr!r}; an env tokenizer "
                "needs encode, decode, apply_chat_template, eos_id and bos_id"
            )
    return tokenizer


def extract_answer(text: str) -> str | None:
    """Text inside the first complete ``<answer>...</answer>`` pair, stripped; None if absent."""
    match = ANSWER_RE.search(text)
    return None if match is None else match.group(1).strip()


def check_reward(reward: Any, *, env: str) -> float:
    """Return ``reward`` as a float, raising if it is not a finite real number."""
    try:
        value = float(reward)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"env {env!r} produced a non-numeric reward {reward!r}") from exc
    if not math.isfinite(value):
        raise NonFiniteReward(
            f"env {env!r} produced a non-finite reward {value!r}; rewards must be finite floats"
        )
    return value


def stop_ids_of(tokenizer: EnvTokenizer) -> tuple[int, ...]:
    """Every id that ends a model turn: ``eos_id`` plus the tokenizer's ``stop_ids`` if any
    (e.g. ByteTokenizer's ``<|endoftext|>`` next to its ``<|im_end|>`` eos)."""
    return tuple(dict.fromkeys((tokenizer.eos_id, *getattr(tokenizer, "stop_ids", ()))))


def model_text(tokenizer: EnvTokenizer, ids: Sequence[int]) -> str:
    """Decode a model turn for scoring only (stop tokens dropped); never fed back as ids."""
    stops = set(stop_ids_of(tokenizer))
    return tokenizer.decode([t for t in ids if t not in stops])


def with_stop_ids(sampling: SamplingParams, *stop_ids: int) -> SamplingParams:
    """``sampling`` with ``stop_ids`` added to its stop tokens (order kept, no duplicates)."""
    merged = tuple(dict.fromkeys((*sampling.stop_token_ids, *stop_ids)))
    if merged == sampling.stop_token_ids:
        return sampling
    return dataclasses.replace(sampling, stop_token_ids=merged)


class Trace:
    """Accumulates one rollout's token trace, keeping the four per-token lists aligned."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.loss_mask: list[bool] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def add_context(self, ids: Sequence[int]) -> None:
        """Prompt or environment-reply tokens: not the model's, never trained on."""
        ids = [int(i) for i in ids]
        self.token_ids += ids
        self.loss_mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NO_VERSION] * len(ids)

    def add_model(self, completion: Completion, n_tokens: int | None = None) -> None:
        """The model's sampled tokens, as the engine returned them.

        ``n_tokens`` keeps only a prefix (an env-side stop string ended the turn early). A
        prefix of sampled tokens is still exactly what the model sampled, with its own
        behavior log-probs, so truncation never makes the trace off-policy.
        """
        n = len(completion.token_ids) if n_tokens is None else n_tokens
        if not 0 <= n <= len(completion.token_ids):
            raise ValueError(f"n_tokens must be in [0, {len(completion.token_ids)}], got {n}")
        self.token_ids += [int(t) for t in completion.token_ids[:n]]
        self.loss_mask += [True] * n
        self.logprobs += [float(x) for x in completion.logprobs[:n]]
        self.versions += [int(v) for v in completion.versions[:n]]

    def rollout(self, **fields: Any) -> Rollout:
        """The finished rollout: this trace and ``fields`` (the rest of ``Rollout``'s), built
        whole rather than filled in afterwards."""
        rollout = Rollout(
            token_ids=list(self.token_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            **fields,
        )
        rollout.validate_trace()
        return rollout


def render_prompt_ids(
    tokenizer: EnvTokenizer, messages: list[dict[str, str]], response_prefix: str, add_bos: bool
) -> list[int]:
    """Chat-template the messages, append the response prefix, encode once."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True) + response_prefix
    ids = list(tokenizer.encode(text))
    if add_bos and (not ids or ids[0] != tokenizer.bos_id):
        if tokenizer.bos_id is None:
            raise ValueError("add_bos=True but the tokenizer has no bos_id")
        ids = [tokenizer.bos_id, *ids]
    return ids


class SingleTurnEnv:
    """One prompt, one completion, one score. Subclasses set ``name`` and implement
    ``build_messages(example)`` and ``score(answer_text, example) -> (reward, metrics)``.

    ``response_prefix`` is appended after the generation prompt (e.g. ``"<answer>"`` to
    pre-open the answer tag for a tiny model); it is part of the prompt ids, and ``score``
    sees ``response_prefix + decoded completion``. ``add_bos`` (default off) prepends
    ``bos_id`` unless the rendered prompt already starts with it; by default the chat template
    alone decides the control tokens (ChatML has no BOS; the Llama 3 template writes its own).
    """

    name: str = "single_turn"
    default_instruction: str = ""

    def __init__(
        self,
        tokenizer: EnvTokenizer,
        *,
        instruction: str | None = None,
        response_prefix: str = "",
        add_bos: bool = False,
    ) -> None:
        self.tokenizer = check_tokenizer(tokenizer)
        self.instruction = self.default_instruction if instruction is None else instruction
        self.response_prefix = response_prefix
        self.add_bos = add_bos

    def build_messages(self, example: dict[str, Any]) -> list[dict[str, str]]:
        raise NotImplementedError

    def score(self, text: str, example: dict[str, Any]) -> tuple[float, dict[str, float]]:
        raise NotImplementedError

    def prompt_ids(self, example: dict[str, Any]) -> list[int]:
        return render_prompt_ids(
            self.tokenizer, self.build_messages(example), self.response_prefix, self.add_bos
        )

    def prompt_text(self, example: dict[str, Any]) -> str:
        """The rendered prompt before encoding (its UTF-8 length bounds its token count)."""
        messages = self.build_messages(example)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True) + (
            self.response_prefix
        )

    async def run(
        self,
        client: InferenceClient,
        example: dict[str, Any],
        *,
        group_id: int,
        episode_id: int,
        sampling: SamplingParams,
    ) -> Rollout:
        trace = Trace()
        trace.add_context(self.prompt_ids(example))
        completion = await client.generate(
            list(trace.token_ids), with_stop_ids(sampling, *stop_ids_of(self.tokenizer))
        )
        trace.add_model(completion)
        text = self.response_prefix + model_text(self.tokenizer, completion.token_ids)
        reward, metrics = self.score(text, example)
        return trace.rollout(
            env=self.name,
            group_id=group_id,
            episode_id=episode_id,
            example=example,
            reward=check_reward(reward, env=self.name),
            num_turns=1,
            temperature=sampling.temperature,
            metrics={**turn_metrics([completion]), **metrics},
            **cut_fields([completion]),
        )


async def close_env(env: Environment) -> None:
    """Release what an env holds open across rollouts (``aclose``: a verifiers env's serving
    context); a no-op for envs that hold nothing. Stages call it on every exit path."""
    aclose = getattr(env, "aclose", None)
    if aclose is not None:
        await aclose()


def turn_metrics(completions: Sequence[Completion]) -> dict[str, float]:
    """Per-rollout metrics shared by every env: tokens the engine generated (including any an
    env-side stop string cut off; the trained ones are ``Rollout.num_model_tokens``),
    whether the last turn hit the length limit, whether any turn ended short (``cut_fields``)."""
    last = completions[-1].finish_reason if completions else "stop"
    return {
        "completion_tokens": float(sum(len(c.token_ids) for c in completions)),
        "truncated": float(last == "length"),
        "cut": float(first_cut(completions) is not None),
    }


def first_cut(completions: Sequence[Completion]) -> str | None:
    """The finish reason of the first of ``completions`` that ended short, or None."""
    for c in completions:
        if not finish_trainable(c.finish_reason):
            return c.finish_reason
    return None


def cut_fields(completions: Sequence[Completion]) -> dict[str, Any]:
    """The ``Rollout`` fields that say whether it may be trained: not when one of its
    ``completions`` ended short (it was scored on partial text); ``cut`` names the reason (the
    train sink counts rollouts by it). Passed to the rollout's constructor, never set later."""
    cut = first_cut(completions)
    return {"trainable": cut is None, "cut": cut}


class AtTemperature:
    """A view of ``env`` whose rollouts always sample at ``temperature``, whatever sampling the
    caller passes (its other fields are kept). Used to evaluate one env twice in one eval pass:
    greedy for the headline number and at the training temperature for the sampled reward.
    Everything but ``run`` is the wrapped env's own."""

    def __init__(self, env: Environment, temperature: float) -> None:
        ok = isinstance(temperature, int | float) and math.isfinite(temperature)
        if not ok or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        self.env = env
        self.temperature = float(temperature)

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet (copy/pickle): do not recurse
            raise AttributeError(name)
        return getattr(self.env, name)

    async def run(self, client: InferenceClient, example: dict[str, Any], **kw: Any) -> Rollout:
        kw["sampling"] = dataclasses.replace(kw["sampling"], temperature=self.temperature)
        return await self.env.run(client, example, **kw)


# --------------------------------------------------------------------------- registry

_BUILTIN: dict[str, str] = {
    "reverse_text": "jaxrl_orch.envs.reverse_text:ReverseTextEnv",
    "arithmetic": "jaxrl_orch.envs.arithmetic:ArithmeticEnv",
    "calculator": "jaxrl_orch.envs.calculator:CalculatorEnv",
    # any verifiers 0.4 environment (the ``verifiers`` extra; its settings: ``Verifiers``)
    "verifiers": "jaxrl_orch.envs.vf.env:VerifiersEnv",
}
_USER: dict[str, Callable[..., Any]] = {}


def env_names() -> list[str]:
    return sorted({*_BUILTIN, *_USER})


def register_env(name: str, factory: Callable[..., Any]) -> None:
    """Register a user environment factory under ``name`` (built-in names are reserved)."""
    if name in _BUILTIN:
        raise ValueError(f"env name {name!r} is a built-in; choose another name")
    _USER[name] = factory


def make_env(name: str, **kwargs: Any) -> RunEnv:
    """Build the environment registered as ``name`` with constructor ``kwargs``; or, for a
    ``"package.module:factory"`` name, what that importable factory returns (every process of
    a multi-process run imports it itself: no registering script needed)."""
    if name in _USER:
        return _USER[name](**kwargs)
    if name not in _BUILTIN and ":" in name:
        hint = f"; or one of the built-in envs {env_names()}"
        return load_factory(name, "Data.env", hint)(**kwargs)
    if name not in _BUILTIN:
        raise ValueError(f"unknown env {name!r}; available envs: {env_names()}")
    module_name, cls_name = _BUILTIN[name].split(":")
    # Imported lazily so base.py does not import its own subclasses' modules at load time.
    return getattr(importlib.import_module(module_name), cls_name)(**kwargs)
