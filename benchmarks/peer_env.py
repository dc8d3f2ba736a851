"""The shared workload of ``benchmarks/peer_tunix.py``: its prompts, its reward, and our side's env.

- ``write_prompts(path)``: the prompt strings both sides train on, one a line, made
  deterministically from the bundled reverse-text corpus: ``"Reverse: "`` + the first 9
  characters of a sentence (no leading or trailing space), so every prompt is exactly
  ``PROMPT_BYTES`` = 18 UTF-8 bytes = 18 ``ByteTokenizer`` ids. Equal lengths mean neither
  side pads a prompt.
- ``lowercase_share(text)``: the reward on both sides, the share of lowercase letters and
  spaces in the completion text (deterministic, cheap, and different for almost every sample).
- ``make(tokenizer=..., **kwargs)``: our side's user environment (``Data.env =
  'peer_env:make'``, with ``benchmarks/`` on ``PYTHONPATH``). A ``SingleTurnEnv`` whose prompt
  ids are the raw prompt text encoded (no chat template, no BOS) and whose turns end only at the
  length limit: its tokenizer view's only stop id is ``NEVER_SAMPLED`` (= the model's vocab
  size, an id no logit produces), so every sample generates exactly ``max_new_tokens`` tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxrl_orch.data.sentences import CORPUS_PATH
from jaxrl_orch.envs.base import SingleTurnEnv
from jaxrl_orch.models.configs import BYTE_VOCAB_SIZE

PREFIX = "Reverse: "
FRAGMENT = 9
PROMPT_BYTES = len(PREFIX) + FRAGMENT
NEVER_SAMPLED = BYTE_VOCAB_SIZE  # one past the last logit: an id no sample can take


def prompts(n: int = 256) -> list[str]:
    """The first ``n`` prompts (see the module docstring), in corpus order."""
    out = []
    for line in CORPUS_PATH.read_text().splitlines():
        frag = line[:FRAGMENT]
        if len(frag) == FRAGMENT and frag == frag.strip() and (p := PREFIX + frag) not in out:
            out.append(p)
        if len(out) == n:
            return out
    raise ValueError(f"the corpus has only {len(out)} usable sentences, {n} asked")


def write_prompts(path: str | Path, n: int = 256) -> Path:
    path = Path(path)
    path.write_text("".join(p + "\n" for p in prompts(n)))
    return path


def lowercase_share(text: str) -> float:
    """Share of lowercase letters and spaces in ``text`` (0 for an empty text)."""
    return sum(c.islower() or c == " " for c in text) / max(len(text), 1)


class NeverStops:
    """A view of a tokenizer whose only stop id is ``NEVER_SAMPLED`` (everything else is the
    wrapped tokenizer's own)."""

    eos_id = NEVER_SAMPLED
    stop_ids = (NEVER_SAMPLED,)

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def __getattr__(self, name: str) -> Any:
        if name == "_tok":
            raise AttributeError(name)
        return getattr(self._tok, name)


class RawPromptEnv(SingleTurnEnv):
    """One raw prompt (the example's text, no chat template), one completion, scored by
    ``lowercase_share``."""

    name = "peer_raw_prompt"

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(NeverStops(tokenizer), **kwargs)

    def build_messages(self, example: dict[str, Any]) -> list[dict[str, str]]:
        return [{"role": "user", "content": example["text"]}]  # unused: prompts are raw

    def prompt_text(self, example: dict[str, Any]) -> str:
        return example["text"]

    def prompt_ids(self, example: dict[str, Any]) -> list[int]:
        return list(self.tokenizer.encode(example["text"]))

    def score(self, text: str, example: dict[str, Any]) -> tuple[float, dict[str, float]]:
        return lowercase_share(text), {}


def make(**kwargs: Any) -> RawPromptEnv:
    return RawPromptEnv(**kwargs)
