"""A tiny Qwen-style chat checkpoint taught a few tool-calling replies, for the tool-call tests.

``tool_chat_host(directory)`` writes a Qwen2.5-style tokenizer directory (the published
template, whose tool branches render ``tools``, assistant ``tool_calls`` and ``tool`` results),
its BPE trained on the scripted conversations so a prompt is ~100-160 ids, then trains a
2-layer model for a few hundred full-batch Adam steps on those conversations (the loss on the
replies only) until its greedy reply to each scripted prompt is the script's, and serves it
from an ``EngineHost``. The prompts are rendered exactly as the server renders a request
(``ChatRequest.conversation``, ``Tool.template_entry``, the checkpoint's template), so what a
client sends is what the model was taught.

``SCRIPTS``: (request messages, reply) pairs in OpenAI's wire shapes: the call, the answer after
the tool's result, two calls in one reply, a malformed call, and a plain reply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrl_orch.inference.engine import DecodeEngine
from jaxrl_orch.inference.limits import EngineLimits
from jaxrl_orch.models.chat_template import ChatTemplate
from jaxrl_orch.models.tokenizer import load_tokenizer
from jaxrl_orch.models.transformer import ModelConfig, Transformer
from jaxrl_orch.serving.host import EngineHost
from jaxrl_orch.serving.openai_schemas import ChatRequest
from support.chat_checkpoints import CORPUS, QWEN_TEMPLATE, write_qwen_tokenizer

MODEL = "tiny-qwen-tools"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def call_text(city: str) -> str:
    call = {"name": "get_weather", "arguments": {"city": city}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"temperature_c": 21}'
ANSWER = "It is 21 C in Paris."
BOTH = [{"role": "user", "content": "Weather in Paris and Rome?"}]
BROKEN = [{"role": "user", "content": "Break the call"}]
BROKEN_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
GREET = [{"role": "user", "content": "Say hello"}]
HELLO = "hello world"


def answered(call_id: str = "call_0") -> list[dict[str, Any]]:
    """``ASK``, the assistant's call (as a client sends it back) and the tool's result."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
    ]


SCRIPTS = [
    (ASK, call_text("Paris")),
    (answered(), ANSWER),
    (BOTH, call_text("Paris") + "\n" + call_text("Rome")),
    (BROKEN, BROKEN_REPLY),
    (GREET, HELLO),
]
LIMITS = EngineLimits(
    max_concurrent_decodes=2, max_target_length=320, max_prefill_length=256, steps_per_call=8
)
STEPS = 300


def served_prompt(template: Any, messages: list[dict[str, Any]]) -> str:
    """The prompt text the server renders for ``messages`` with ``TOOLS`` in use."""
    req = ChatRequest.model_validate({"messages": messages, "tools": TOOLS})
    tools = [t.template_entry() for t in req.tools]
    return template(req.conversation(), add_generation_prompt=True, tools=tools)


def _batch(tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """The scripted conversations as one padded batch, and the mask of reply positions."""
    render = tokenizer.apply_chat_template
    rows = []
    for messages, reply in SCRIPTS:
        prompt = tokenizer.encode(served_prompt(render, messages))
        rows.append((prompt, tokenizer.encode(reply) + [tokenizer.eos_id]))
    width = max(len(p) + len(r) for p, r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    targets = np.zeros((len(rows), width), np.float32)  # 1 where the next id is taught
    for i, (prompt, reply) in enumerate(rows):
        tokens[i, : len(prompt) + len(reply)] = prompt + reply
        targets[i, len(prompt) - 1 : len(prompt) + len(reply) - 1] = 1
    return tokens, targets


def _train(cfg: ModelConfig, tokens: np.ndarray, targets: np.ndarray) -> Any:
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    opt = optax.adam(3e-3)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    nxt, mask = tokens[:, 1:], targets[:, :-1]

    def loss(st):
        logits = nnx.merge(graphdef, st)(tokens, positions)[:, :-1]
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), nxt[..., None], -1)[..., 0]
        return (nll * mask).sum() / mask.sum(), logits.argmax(-1)

    @jax.jit
    def step(st, opt_state):
        (value, greedy), grads = jax.value_and_grad(loss, has_aux=True)(st)
        updates, opt_state = opt.update(grads, opt_state, st)
        return optax.apply_updates(st, updates), opt_state, value, greedy

    opt_state = opt.init(state)
    for _ in range(STEPS):
        state, opt_state, value, greedy = step(state, opt_state)
    wrong = int(((np.asarray(greedy) != nxt) & (mask > 0)).sum())
    if wrong:  # the fixture's own failure, not the server's: say so
        raise AssertionError(f"the scripted model did not learn its replies: {wrong} ids wrong")
    return state


def tool_chat_host(directory: Path) -> EngineHost:
    template = ChatTemplate(QWEN_TEMPLATE)
    corpus = [*CORPUS, *(served_prompt(template.render, m) + r for m, r in SCRIPTS)]
    tokenizer = load_tokenizer(write_qwen_tokenizer(directory, vocab_size=600, corpus=corpus))
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
    )
    state = _train(cfg, *_batch(tokenizer))
    engine = DecodeEngine(cfg, limits=LIMITS, decode_widths=(2,))
    return EngineHost(engine, model=MODEL, tokenizer=tokenizer, params=engine.load_params(state))
