"""DecodeEngine: the Transformer behind JetStream's Engine methods, with RL extras.

Owns the device side of decoding: params placement on the decode mesh, the fixed-shape decode
state (layout and slot operations in ``decode_state``) and its jitted programs: ``prefill``
(one prompt -> a prefix KV), ``insert`` (prefix -> slot), ``generate`` (``steps_per_call``
decode steps for every slot in one ``lax.scan``, one host round trip: ``decode_program``),
``move_slot`` for drivers that narrow the decode width, and two compiled only on first use:
``score`` (a prefill that also returns the prompt's log-probs and top-k, ``scoring``) and
``generate(..., top_logprobs=True)`` (the decode variant that also returns each token's top-k).

Construction: ``DecodeEngine(config, *, mesh, limits=EngineLimits(...), decode_widths,
cache_dtype, param_dtype, tokenizer, seed, programs)``. ``limits`` (``inference/limits.py``) fixes
every shape: slots, cache length, prefill limit, steps per call, stop ids per slot; the engine
exposes them under JetStream's names (``max_concurrent_decodes``, ``max_prefill_length``,
``max_target_length``, ``steps_per_call``, ``max_stop_tokens``), read-only. Each jitted program
goes through ``programs(group, name, jitted)`` when given (``compose.executables``).

Decode width: a step's cost is nearly proportional to the slots it runs (measured 2.9 / 6.3 /
11.4 / 16.5 ms per step at 4 / 8 / 16 / 32 slots of small-byte), so ``generate(..., width=w)``
runs only slots ``[0, w)`` for w in ``decode_widths`` (default: the slot count and its halvings
down to 1/8 of it, one program each); rows at or beyond w are untouched. Tokens and log-probs
do not depend on the width (the same per-slot computation).

Contract details (see ``engine_api`` for the result layout):
- ``prefill`` computes the prompt's KV but samples nothing: the slot's first generate step
  re-feeds the last prompt token (re-writing the same KV, up to float rounding, at its index)
  and samples the first completion token there. So one prefix inserted into G slots (prefix
  sharing) still gives G independent first tokens (G equal ones if they share a seed), and
  every generated token carries the version of the generate call that sampled it (and a
  seeded request's token 0 its key at i = 0). Prefill's ``ResultTokens`` has valid = 0.
- Sampling parameters (temperature, top-k, top-p, stop ids, max tokens) are given per slot at
  ``insert(prefix, state, slot, sampling=...)`` (one shared prefix, G different settings) and
  live as arrays in the decode state: a new request never recompiles anything.
  Log-probs follow ``sampling.sample_tokens``: ``log_softmax(logits / T)`` over the full
  vocabulary at the sampled id; greedy (T = 0) slots report ``log_softmax(logits)``. The
  top-k variant's alternatives come from that same distribution; ``score``'s from the raw
  logits (T = 1), as the trainer's log-probs at T = 1.
- Randomness: a request with ``SamplingParams.seed`` draws completion token i (i = 0 is the one
  the first generate step samples) from ``fold_in(fold_in(PRNGKey(seed), prompt_len), i)``
  (``sampling.row_keys``; the key and i live per slot, so ``move_slot`` and narrow widths keep
  them): its tokens do not depend on the engine, its seed, the slot or the batch. Unseeded
  slots share the engine's ``rng`` stream (split per step, then per row of the width).
- A slot finishes on a stop id (included), on ``max_tokens``, or when the next position would
  not fit the cache (``max_target_length``); afterwards it reports no valid tokens until a new
  prefix is inserted. Inactive slots still run through the fixed-shape step; their writes land
  at indices the next occupant overwrites before attending (transformer.forward_cached).
- ``generate(params, state, version=v)`` stamps v on every token of the call; params may be
  swapped between any two calls (same tree structure -> no recompile).

Sharding and dtype: params (in ``param_dtype``, default the compute dtype: bf16 on TPU),
cache and prefix are placed with ``sharding.rules.resolve_shardings`` under ``DECODE_RULES`` on
the ``("tp",)`` mesh (1 device by default); per-slot vectors are replicated. Hot paths use
``nnx.split`` + ``jax.jit`` with explicit out shardings and donate the decode state;
``python -m jaxrl_orch.tools.aot`` lowers ``prefill_program`` / ``generate_program`` against
``abstract_params`` / ``abstract_decode_state``. Drivers call this engine from one thread; it
holds no locks and never blocks on anything but the device.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_orch.inference import decode_state as dstate  # the JetStream args are named decode_state
from jaxrl_orch.inference.decode_program import decode_steps, result_tokens
from jaxrl_orch.inference.engine_api import ResultTokens
from jaxrl_orch.inference.limits import MAX_TOP_LOGPROBS, EngineLimits
from jaxrl_orch.inference.scoring import prompt_scores
from jaxrl_orch.models.tokenizer import ByteTokenizer, Tokenizer
from jaxrl_orch.models.transformer import (
    ModelConfig,
    Transformer,
    cache_logical_specs,
    init_cache,
    logical_specs,
)
from jaxrl_orch.types import SamplingParams
from sharding.reshard import reshard
from sharding.rules import DECODE_RULES, abstract_arrays, resolve_shardings


class DecodeEngine:
    def __init__(
        self,
        config: ModelConfig,
        *,
        mesh: Mesh | None = None,
        limits: EngineLimits = EngineLimits(),
        decode_widths: Sequence[int] | None = None,
        cache_dtype: Any = None,
        param_dtype: Any = None,
        tokenizer: Tokenizer | None = None,
        seed: int = 0,
        programs: Callable[[str, str, Any], Any] | None = None,
    ) -> None:
        self.limits = limits
        slots = limits.max_concurrent_decodes
        widths = dstate.check_widths(decode_widths, slots)
        if mesh is None:
            mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
        if "tp" not in mesh.axis_names:
            raise ValueError(f"decode mesh needs a 'tp' axis, got axes {mesh.axis_names}")
        # Params in the compute dtype unless told otherwise: every matmul casts to it anyway.
        self.param_dtype = jnp.dtype(param_dtype or config.dtype)
        self.config = config = dataclasses.replace(config, param_dtype=self.param_dtype)
        self._mesh = mesh
        self.decode_widths = widths
        self.cache_dtype = jnp.dtype(cache_dtype or config.dtype)
        self._tokenizer = tokenizer
        self._seed = seed
        # The group of its programs names all they are built from besides their arguments.
        group = f"engine {(config, limits, str(self.cache_dtype), seed)!r}"
        self._program = (
            (lambda _, fn: fn) if programs is None else functools.partial(programs, group)
        )

        abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
        self._graphdef, abstract_state = nnx.split(abstract)
        self.param_shardings = resolve_shardings(
            logical_specs(abstract_state), mesh, DECODE_RULES, shapes=_shapes(abstract_state)
        )
        self._replicated = NamedSharding(mesh, PartitionSpec())
        self._cache_shardings = self._cache_sharding(limits.max_target_length, slots)
        self._state_shardings = {
            **{k: self._replicated for k in dstate.STATE_KEYS},
            "cache": self._cache_shardings,
        }
        self._init_fn: Any = None
        self._init_state_fn: Any = None
        self._prefill_fns: dict[int, Any] = {}
        self._insert_fns: dict[int, Any] = {}
        self._generate_fns: dict[int, Any] = {}
        self._top_generate_fns: dict[int, Any] = {}  # the top-k variants, by width
        self._score_fns: dict[int, Any] = {}
        self._move_fn = self._program(
            "move",
            jax.jit(dstate.move, donate_argnums=(0,), out_shardings=self._state_shardings),
        )

    # ------------------------------------------------------------------ JetStream properties

    # JetStream's read-only properties.
    max_concurrent_decodes = property(lambda self: self.limits.max_concurrent_decodes)
    max_prefill_length = property(lambda self: self.limits.max_prefill_length)
    samples_per_slot = property(lambda self: 1)
    mesh = property(lambda self: self._mesh)
    colocated_cpus = property(lambda self: None)
    # The other limits, read by drivers and tools under their JetStream-era names.
    max_target_length = property(lambda self: self.limits.max_target_length)
    steps_per_call = property(lambda self: self.limits.steps_per_call)
    max_stop_tokens = property(lambda self: self.limits.max_stop_tokens)
    # Alternatives per token the scoring and top-k programs compute (the driver keeps k of them).
    max_top_logprobs = property(lambda self: min(MAX_TOP_LOGPROBS, self.config.vocab_size))

    def get_tokenizer(self) -> Tokenizer:
        if self._tokenizer is None and self.config.vocab_size == ByteTokenizer().vocab_size:
            self._tokenizer = ByteTokenizer()
        if self._tokenizer is None:
            raise ValueError(
                f"no tokenizer was given and vocab_size={self.config.vocab_size} is not the "
                "byte tokenizer's; pass tokenizer= to DecodeEngine"
            )
        return self._tokenizer

    def get_prefix_destination_sharding(self) -> Any:
        return {"cache": self._cache_sharding(None, 1)}

    # ------------------------------------------------------------------ params and state

    def load_params(self, state: Any = None, *, seed: int | None = None) -> Any:
        """Place ``state`` (an ``nnx.State`` from ``nnx.split``) on the decode mesh, or build
        fresh random params from ``seed`` when no state is given."""
        if state is None:
            if self._init_fn is None:
                build = lambda s: nnx.split(
                    Transformer(self.config, rngs=nnx.Rngs(jax.random.key(s)))
                )[1]
                self._init_fn = jax.jit(build, out_shardings=self.param_shardings)
            with jax.set_mesh(self._mesh):
                return self._init_fn(np.uint32(self._seed if seed is None else seed))
        return reshard(state, self.param_shardings, dtype=self.param_dtype)

    def abstract_params(self) -> Any:
        """``ShapeDtypeStruct`` params with this engine's dtype and shardings (AOT lowering)."""
        abstract = nnx.split(nnx.eval_shape(lambda: Transformer(self.config, rngs=nnx.Rngs(0))))
        return abstract_arrays(abstract[1], self.param_shardings)

    def abstract_decode_state(self) -> Any:
        """``ShapeDtypeStruct`` decode state with its shardings (AOT lowering)."""
        return abstract_arrays(jax.eval_shape(self._build_state), self._state_shardings)

    def _build_state(self) -> dict[str, Any]:
        lim = self.limits
        args = (lim.max_concurrent_decodes, lim.max_target_length, self.cache_dtype)
        return dstate.build(self.config, *args, lim.max_stop_tokens, self._seed)

    def init_decode_state(self) -> dict[str, Any]:
        if self._init_state_fn is None:  # compiled once: a driver restart must not recompile
            self._init_state_fn = self._program(
                "init_state", jax.jit(self._build_state, out_shardings=self._state_shardings)
            )
        return self._init_state_fn()

    # ------------------------------------------------------------------ prefill / insert

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: Any = None,
        padded_tokens: Any,
        true_length: int,
    ) -> tuple[dict[str, Any], ResultTokens]:
        if existing_prefix is not None:
            raise NotImplementedError("DecodeEngine.prefill does not extend an existing_prefix")
        tokens = self._padded(padded_tokens, true_length)
        prefix = self.prefill_program(tokens.shape[0])(params, tokens[None])
        nothing = np.zeros((1, 3), np.int32)  # the first token is sampled by generate
        result = ResultTokens(nothing, (0, 1), (1, 2), (2, 3))
        return self._ends(prefix, tokens, true_length), result

    def score(
        self, *, params: Any, padded_tokens: Any, true_length: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``prefill``'s prefix of the prompt and, from the same forward, its scores
        (``scoring.prompt_scores``, ``MAX_TOP_LOGPROBS`` alternatives, on the device)."""
        tokens = self._padded(padded_tokens, true_length)
        prefix, scores = self.score_program(tokens.shape[0])(params, tokens[None])
        return self._ends(prefix, tokens, true_length), scores

    def _padded(self, padded_tokens: Any, true_length: int) -> np.ndarray:
        tokens = np.asarray(padded_tokens, dtype=np.int32).reshape(-1)
        length = tokens.shape[0]
        if length > self.max_prefill_length:
            raise ValueError(
                f"padded_tokens has {length} tokens; max_prefill_length={self.max_prefill_length}"
            )
        if not 1 <= true_length <= length:
            raise ValueError(f"true_length must be in [1, {length}], got {true_length}")
        return tokens

    @staticmethod
    def _ends(prefix: dict[str, Any], tokens: np.ndarray, true_length: int) -> dict[str, Any]:
        """The prompt's last token and position, which the slot's first step re-feeds."""
        prefix["token"] = np.int32(tokens[true_length - 1])
        prefix["pos"] = np.int32(true_length - 1)
        return prefix

    def prefill_program(self, length: int) -> Any:
        """The jitted prefill of a ``[1, length]`` prompt (one program per padded length)."""
        fn = self._prefill_fns.get(length)
        if fn is None:
            out = {"cache": self._cache_sharding(length, 1)}
            fn = jax.jit(self._prefill_impl, out_shardings=out)
            fn = self._prefill_fns[length] = self._program(f"prefill[{length}]", fn)
        return fn

    def score_program(self, length: int) -> Any:
        """The jitted scoring prefill of a ``[1, length]`` prompt (compiled on first use)."""
        fn = self._score_fns.get(length)
        if fn is None:
            out = ({"cache": self._cache_sharding(length, 1)}, self._replicated)
            fn = jax.jit(self._score_impl, out_shardings=out)
            fn = self._score_fns[length] = self._program(f"score[{length}]", fn)
        return fn

    def _prefill_impl(self, params: Any, tokens: jax.Array) -> dict[str, Any]:
        _, cache = self._forward(params, tokens)
        return {"cache": cache}

    def _score_impl(self, params: Any, tokens: jax.Array) -> tuple[dict[str, Any], Any]:
        logits, cache = self._forward(params, tokens)
        top = self.max_top_logprobs
        return {"cache": cache}, prompt_scores(logits[0], tokens[0], top)

    def _forward(self, params: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        model = nnx.merge(self._graphdef, params)
        cache = init_cache(self.config, 1, tokens.shape[1], self.cache_dtype)
        positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        return model.forward_cached(tokens, positions, cache)

    def insert(
        self,
        prefix: dict[str, Any],
        decode_state: dict[str, Any],
        slot: int,
        *,
        sampling: SamplingParams | None = None,
    ) -> dict[str, Any]:
        """Put ``prefix`` into ``slot`` with its own ``sampling`` (default: SamplingParams())."""
        if not 0 <= slot < self.max_concurrent_decodes:
            raise ValueError(f"slot must be in [0, {self.max_concurrent_decodes}), got {slot}")
        fields = dstate.slot_fields(prefix, sampling or SamplingParams(), self.max_stop_tokens)
        length = jax.tree.leaves(prefix["cache"])[0].shape[-2]
        fn = self._insert_fns.get(length)
        if fn is None:
            fn = jax.jit(dstate.insert, donate_argnums=(0,), out_shardings=self._state_shardings)
            fn = self._insert_fns[length] = self._program(f"insert[{length}]", fn)
        return fn(decode_state, prefix["cache"], fields, np.int32(slot))

    def move_slot(self, decode_state: dict[str, Any], src: int, dst: int) -> dict[str, Any]:
        """Move the request in slot ``src`` (KV rows and per-slot fields) to slot ``dst``;
        ``src`` becomes inactive. Lets a driver pack running requests below a narrower width."""
        for name, slot in (("src", src), ("dst", dst)):
            if not 0 <= slot < self.max_concurrent_decodes:
                raise ValueError(
                    f"{name} slot must be in [0, {self.max_concurrent_decodes}), got {slot}"
                )
        return self._move_fn(decode_state, np.int32(src), np.int32(dst))

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        params: Any,
        decode_state: dict[str, Any],
        *,
        version: int = 0,
        width: int | None = None,
        top_logprobs: bool = False,
    ) -> tuple[dict[str, Any], ResultTokens]:
        """``steps_per_call`` decode steps of slots ``[0, width)`` (default: every slot).

        Slots at or beyond ``width`` are left untouched (their requests do not advance) and the
        result has ``width`` rows; a driver narrows the width only once every running request
        sits below it (``move_slot``). ``top_logprobs``: run the top-k variant, whose result
        also holds each token's ``MAX_TOP_LOGPROBS`` most likely alternatives.
        """
        width = self.max_concurrent_decodes if width is None else width
        program = self.generate_program(width, top_logprobs=top_logprobs)
        state, data = program(params, decode_state, np.int32(version))
        top = self.max_top_logprobs if top_logprobs else 0
        return state, result_tokens(data, self.steps_per_call, top)

    def generate_program(self, width: int, *, top_logprobs: bool = False) -> Any:
        """The jitted ``steps_per_call`` decode steps of slots ``[0, width)`` (the top-k
        variant with ``top_logprobs``: a program of its own, compiled on first use)."""
        fns = self._top_generate_fns if top_logprobs else self._generate_fns
        fn = fns.get(width)
        if fn is None:
            if width not in self.decode_widths:
                raise ValueError(
                    f"width must be one of decode_widths={self.decode_widths}, got {width!r}"
                )
            top = self.max_top_logprobs if top_logprobs else 0
            fn = jax.jit(
                functools.partial(self._generate_impl, width=width, top=top),
                donate_argnums=(1,),
                out_shardings=(self._state_shardings, self._replicated),
            )
            fn = fns[width] = self._program(f"generate[{width},{top}]", fn)
        return fn

    def _generate_impl(
        self, params: Any, full: dict[str, Any], version: jax.Array, *, width: int, top: int
    ) -> tuple[dict[str, Any], jax.Array]:
        model = nnx.merge(self._graphdef, params)
        state, data = decode_steps(
            model,
            dstate.head(full, width),
            version,
            length=self.max_target_length,
            steps=self.steps_per_call,
            top=top,
        )
        if width == self.max_concurrent_decodes:  # every slot: the state itself, no copy
            return state, data
        return dstate.put_head(full, state), data

    # ------------------------------------------------------------------ helpers

    # One entry per (length, batch); the cache lives as long as the engine, which is intended.
    @functools.cache  # noqa: B019
    def _cache_sharding(self, length: int | None, batch: int) -> dict[str, Any]:
        specs = cache_logical_specs(self.config)
        shapes = None
        if length is not None:
            shapes = jax.eval_shape(
                lambda: init_cache(self.config, batch, length, self.cache_dtype)
            )
        return resolve_shardings(specs, self._mesh, DECODE_RULES, shapes=shapes)


def _shapes(abstract_state: Any) -> Any:
    """Shape tuples at each variable of an abstract ``nnx.State`` (for divisibility checks)."""
    return jax.tree.map(
        lambda v: tuple(v.shape), abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
