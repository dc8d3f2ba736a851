"""Every example checked before the first step: each RL prompt and each warm-up sample fits.

What it owns: ``check_examples(parts, max_prefill)``, called by ``compose.parts.build_run``. It
reads every example of the warm-up source (prompt + demonstration + EOS within ``row_len``), the
RL train source and both held-out sources (prompt within the engine's prefill limit and, with
``max_new_tokens``, within ``row_len``): reading one decodes it, so a record that does not
decode fails here too. The first example that does not fit fails naming where it is (file
and line for a text file, index and dataset otherwise), its token count, the limit and the
setting to change.

Cheap on large files: a rendered prompt's UTF-8 byte count (+2 for BOS/EOS) bounds its token
count for byte-level tokenizers (every token but a special one covers at least one byte, and
a special token stands for several bytes of its text), so only examples whose bound exceeds the
limit are tokenized. Environments that cannot render a prompt as text are tokenized in full.

Once per data: a passed check is kept in the workdir under a key of the data, the tokenizer,
the settings and the code (``compose.verdict``), and a later start with the same key reads
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxrl_orch.compose.verdict import examples_key, recalled, remember
from jaxrl_orch.data.sources import DatasetSource

if TYPE_CHECKING:
    from jaxrl_orch.compose.parts import RunParts


def where(source: DatasetSource, i: int) -> str:
    """Where example ``i`` of ``source`` comes from, for an error message."""
    at = getattr(source, "where", None)
    return at(i) if at is not None else f"example {i} of {getattr(source, 'name', source)}"


def check_fits(
    source: DatasetSource,
    *,
    measure: Callable[[dict[str, Any]], int],
    limit: int,
    what: str,
    fix: str,
    text_of: Callable[[dict[str, Any]], str] | None = None,
) -> int:
    """Every example of ``source``: ``measure(ex) <= limit``. Returns how many were tokenized."""
    tokenized = 0
    for i in range(len(source)):
        ex = source.example_at(i)
        if text_of is not None and len(text_of(ex).encode("utf-8")) + 2 <= limit:
            continue
        tokenized += 1
        n = measure(ex)
        if n > limit:
            shown = str(ex)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ValueError(
                f"{what} has {n} tokens, over the limit of {limit}: {where(source, i)} "
                f"({shown}); {fix}"
            )
    return tokenized


def check_examples(parts: RunParts, max_prefill: int) -> bool:
    """See the module docstring (``max_prefill``: the engine's prompt limit). Returns whether
    the verdict of an earlier start stood (nothing was read)."""
    samples = bool(parts.cfg.warmup.steps and parts.demonstrator is not None)
    sources = [parts.data.sft] if samples else []
    key = examples_key(parts, [*sources, parts.data.train, parts.data.eval], max_prefill)
    if key is not None and recalled(parts, key):
        return True
    _check_all(parts, max_prefill, samples)
    if key is not None:
        remember(parts, key)
    return False


def _check_all(parts: RunParts, max_prefill: int, samples: bool) -> None:
    cfg = parts.cfg
    env = parts.env
    data = parts.data
    text_of = getattr(env, "prompt_text", None)
    if samples:

        def sample_text(ex: dict[str, Any]) -> str:
            return text_of(ex) + parts.demonstrator.completion(ex)

        check_fits(
            data.sft,
            measure=lambda ex: len(parts.sft_sample(ex)),
            limit=cfg.trainer.row_len,
            what="a warm-up sample (prompt + demonstration + EOS)",
            fix="raise Trainer.row_len, shorten Data.instruction or drop the example",
            text_of=None if text_of is None else sample_text,
        )
    limit = min(max_prefill, cfg.trainer.row_len - cfg.rl.max_new_tokens)
    why = (
        f"the engine's prefill limit {max_prefill} (max_target_length // 2) and row_len "
        f"{cfg.trainer.row_len} - max_new_tokens {cfg.rl.max_new_tokens}"
    )
    for name, source in (("RL", data.train), ("eval", data.eval)):
        check_fits(
            source,
            measure=lambda ex: len(env.prompt_ids(ex)),
            limit=limit,
            what=f"an {name} prompt",
            fix=f"the limit is the smaller of {why}: raise those settings or drop the example",
            text_of=text_of,
        )
