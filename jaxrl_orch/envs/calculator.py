"""Calculator environment: a multi-turn tool-use task over one growing token history.

Protocol (plain text, so a byte-level model can learn it)
- The prompt states the question and the two tags. In each turn the model either calls the
  tool with ``<calc>EXPR</calc>`` or finishes with ``<answer>N</answer>``.
- A turn that contains ``</calc>`` (after ``<calc>``, before any ``<answer>``) is cut right
  after the token that completes ``</calc>``: anything the model sampled past it would be a
  hallucinated tool result. The kept tokens are a prefix of what the engine sampled, with
  their own log-probs and versions, so the trace stays exactly on-policy. The environment
  then evaluates EXPR with the safe parser in ``envs/expression.py`` (never ``eval``) and
  appends its reply ``<result>VALUE</result>`` (or ``<result>error: ...</result>``) as
  environment tokens, and calls ``generate`` again with the whole history.
- The episode ends on a turn without a tool call, after ``max_turns`` model turns, when the
  history would exceed ``max_context_tokens``, or when a turn ended short (a pause's abort, a
  caller gone: ``base.first_cut``); such an episode is never trained (``base.cut_fields``).

Trace invariants (tested with a scripted client): ``token_ids`` = prompt + turn 1 + reply 1 +
turn 2 + ...; ``loss_mask`` is True exactly on model-turn tokens; environment replies and the
prompt carry logprob 0.0 and ``NO_VERSION``; each model turn keeps the versions the engine
stamped on it, so a weight swap between turns shows up as a version change mid-trace.

Reward: 1.0 when the final turn's ``<answer>`` holds the exact integer result, else 0.0
(binary). A malformed episode scores 0; only broken machinery raises.

Example schema: ``{"question": str, "answer": int | str}`` (e.g. the ``jaxrl_arithmetic``
dataset, whose ``question`` is an expression such as ``"37*48"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxrl_orch.envs.arithmetic import parse_int_answer, truth_int
from jaxrl_orch.envs.base import (
    EnvTokenizer,
    Trace,
    check_reward,
    check_tokenizer,
    cut_fields,
    extract_answer,
    first_cut,
    model_text,
    render_prompt_ids,
    stop_ids_of,
    turn_metrics,
    with_stop_ids,
)
from jaxrl_orch.envs.expression import ExpressionError, evaluate, format_value
from jaxrl_orch.types import Completion, InferenceClient, Rollout, SamplingParams

DEFAULT_INSTRUCTION = "Use <calc>2*3</calc> if needed. Reply <answer></answer>."
CALL_OPEN = "<calc>"
CALL_CLOSE = "</calc>"


def find_call(text: str) -> tuple[str, int] | None:
    """``(expression, end offset of "</calc>")`` of the first tool call not preceded by an
    answer tag, or None when the text makes no call."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return None
    answer_at = text.find("<answer>")
    if 0 <= answer_at < start:
        return None
    end = text.find(CALL_CLOSE, start + len(CALL_OPEN))
    if end < 0:
        return None
    return text[start + len(CALL_OPEN) : end], end + len(CALL_CLOSE)


def tool_reply(expression: str) -> tuple[str, bool]:
    """The environment's reply text to one tool call, and whether the call failed."""
    try:
        return f"<result>{format_value(evaluate(expression))}</result>", False
    except ExpressionError as exc:
        return f"<result>error: {exc}</result>", True


class CalculatorEnv:
    name = "calculator"

    def __init__(
        self,
        tokenizer: EnvTokenizer,
        *,
        instruction: str = DEFAULT_INSTRUCTION,
        max_turns: int = 4,
        max_context_tokens: int | None = None,
        add_bos: bool = False,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns!r}")
        if max_context_tokens is not None and max_context_tokens < 2:
            raise ValueError(f"max_context_tokens must be >= 2 or None, got {max_context_tokens}")
        self.tokenizer = check_tokenizer(tokenizer)
        self.instruction = instruction
        self.max_turns = max_turns
        self.max_context_tokens = max_context_tokens
        self.add_bos = add_bos

    def prompt_ids(self, example: dict[str, Any]) -> list[int]:
        question = example.get("question")
        if not isinstance(question, str) or not question:
            raise ValueError(
                f"calculator example needs a non-empty str 'question' field, got {example!r}"
            )
        truth_int(example)
        messages = [{"role": "user", "content": f"{self.instruction}\n{question}="}]
        return render_prompt_ids(self.tokenizer, messages, "", self.add_bos)

    def _decode(self, ids: Sequence[int]) -> str:
        return model_text(self.tokenizer, ids)

    def _cut_after(self, ids: Sequence[int], offset: int) -> int:
        """Fewest leading tokens whose decoded text reaches ``offset`` characters.

        Decoded-prefix length grows monotonically with the token count, so binary search.
        """
        lo = 1
        hi = len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._decode(ids[:mid])) >= offset:
                hi = mid
            else:
                lo = mid + 1
        return lo

    async def run(
        self,
        client: InferenceClient,
        example: dict[str, Any],
        *,
        group_id: int,
        episode_id: int,
        sampling: SamplingParams,
    ) -> Rollout:
        sampling = with_stop_ids(sampling, *stop_ids_of(self.tokenizer))
        trace = Trace()
        prompt = self.prompt_ids(example)
        if self.max_context_tokens is not None and len(prompt) >= self.max_context_tokens:
            raise ValueError(
                f"calculator prompt has {len(prompt)} tokens, not below max_context_tokens="
                f"{self.max_context_tokens}; shorten the question or raise the limit"
            )
        trace.add_context(prompt)
        completions: list[Completion] = []
        final_text = ""
        tool_calls = tool_errors = 0
        context_exhausted = finished = False
        for turn in range(self.max_turns):
            completion = await client.generate(list(trace.token_ids), sampling)
            completions.append(completion)
            text = self._decode(completion.token_ids)
            call = None if first_cut([completion]) else find_call(text)
            if call is None:
                trace.add_model(completion)
                final_text = text
                finished = True
                break
            expression, end = call
            trace.add_model(completion, self._cut_after(completion.token_ids, end))
            tool_calls += 1
            if turn == self.max_turns - 1:
                break  # no turn left to read a reply in
            reply, failed = tool_reply(expression)
            tool_errors += int(failed)
            reply_ids = list(self.tokenizer.encode(reply))
            if (
                self.max_context_tokens is not None
                and len(trace) + len(reply_ids) >= self.max_context_tokens
            ):
                context_exhausted = True
                break
            trace.add_context(reply_ids)

        answer = parse_int_answer(final_text) if extract_answer(final_text) is not None else None
        reward = float(answer is not None and answer == truth_int(example))
        metrics = turn_metrics(completions)
        metrics["truncated"] = max(metrics["truncated"], float(context_exhausted))
        return trace.rollout(
            env=self.name,
            group_id=group_id,
            episode_id=episode_id,
            example=example,
            reward=check_reward(reward, env=self.name),
            num_turns=len(completions),
            temperature=sampling.temperature,
            metrics={
                **metrics,
                "format_ok": float(answer is not None),
                "tool_calls": float(tool_calls),
                "tool_errors": float(tool_errors),
                "max_turns_reached": float(not finished and not context_exhausted),
            },
            **cut_fields(completions),
        )
