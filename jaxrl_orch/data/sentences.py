"""Seeded sentence grammar behind the bundled reverse-text corpus (``corpus/sentences.txt``).

The corpus is synthetic on purpose: it is ours to ship, it is reproducible bit for bit from
``(count, seed)``, and its sentences have the shape of a short encyclopedia line ("In 1891 the
community inaugurated its own cemetery"): a short clause of subject, verb, object, with an
optional year or place, 20 to 47 characters long, so that with the default reverse-text
instruction and the byte chat template every prompt is at most 80 tokens (mean ~72).

Grammar: one of five templates (year-first, year-last, adjective subject, place, pluperfect
"By YEAR ...") filled from small hand-written word lists with ``random.Random(seed)``;
sentences outside ``[MIN_CHARS, MAX_CHARS]`` or already produced are rejected, so the output
is ``count`` distinct sentences in generation order. ``random.Random``'s integer draws are
stable across Python versions, which is what makes the shipped file regenerable; a test
checks the shipped file equals ``generate_sentences()``.

Regenerate: ``python -m jaxrl_orch.data.sentences`` (rewrites ``corpus/sentences.txt``).
"""

from __future__ import annotations

import random
from pathlib import Path

MIN_CHARS = 20
MAX_CHARS = 47
DEFAULT_COUNT = 4000
DEFAULT_SEED = 1891
CORPUS_PATH = Path(__file__).parent / "corpus" / "sentences.txt"

SUBJECTS = (
    "community",
    "village",
    "council",
    "guild",
    "museum",
    "school",
    "parish",
    "company",
    "orchestra",
    "family",
    "harbour",
    "railway",
    "college",
    "town",
    "abbey",
    "garrison",
    "club",
    "bakery",
    "mill",
    "hospital",
    "library",
    "choir",
    "farm",
    "theatre",
    "society",
)
VERBS = (
    "opened",
    "built",
    "restored",
    "sold",
    "closed",
    "painted",
    "moved",
    "named",
    "found",
    "repaired",
    "bought",
    "lost",
    "rebuilt",
    "enlarged",
    "inaugurated",
    "planted",
    "mapped",
    "measured",
    "guarded",
    "cleaned",
    "renamed",
    "shared",
    "visited",
    "printed",
)
PARTICIPLES = (
    "opened",
    "built",
    "restored",
    "sold",
    "closed",
    "painted",
    "moved",
    "named",
    "found",
    "repaired",
    "bought",
    "lost",
    "rebuilt",
    "enlarged",
    "planted",
    "mapped",
    "renamed",
)
DETERMINERS = ("its", "the", "a", "its own", "one", "every")
ADJECTIVES = (
    "new",
    "old",
    "small",
    "large",
    "red",
    "stone",
    "wooden",
    "quiet",
    "busy",
    "first",
    "last",
    "narrow",
    "broad",
    "famous",
    "hidden",
    "northern",
    "southern",
    "empty",
)
OBJECTS = (
    "cemetery",
    "bridge",
    "chapel",
    "market",
    "tower",
    "school",
    "garden",
    "well",
    "road",
    "station",
    "harbour",
    "orchard",
    "fountain",
    "gate",
    "wall",
    "hall",
    "clock",
    "barn",
    "canal",
    "lighthouse",
    "organ",
    "statue",
    "square",
    "ferry",
    "archive",
    "kiln",
)
PLACES = (
    "by the river",
    "near the coast",
    "in the valley",
    "on the hill",
    "at the crossroads",
    "in the old town",
    "beyond the forest",
    "by the lake",
    "in winter",
    "after the flood",
)


def _noun_phrase(det: str, *words: str) -> str:
    if det == "a" and words[0][0] in "aeiou":
        det = "an"
    return " ".join((det, *words))


def _sentence(rng: random.Random) -> str:
    year = rng.randint(1500, 2024)
    subj = rng.choice(SUBJECTS)
    verb = rng.choice(VERBS)
    obj = rng.choice(OBJECTS)
    det = rng.choice(DETERMINERS)
    adj = rng.choice(ADJECTIVES)
    template = rng.randrange(5)
    if template == 0:
        return f"In {year} the {subj} {verb} {_noun_phrase(det, adj, obj)}"
    if template == 1:
        return f"The {subj} {verb} {_noun_phrase(det, obj)} in {year}"
    if template == 2:
        return f"The {adj} {subj} {verb} {_noun_phrase(det, obj)}"
    if template == 3:
        return f"The {subj} {verb} {_noun_phrase(det, obj)} {rng.choice(PLACES)}"
    return f"By {year} the {subj} had {rng.choice(PARTICIPLES)} {_noun_phrase(det, obj)}"


def generate_sentences(count: int = DEFAULT_COUNT, seed: int = DEFAULT_SEED) -> list[str]:
    """``count`` distinct sentences of ``MIN_CHARS..MAX_CHARS`` characters, deterministic."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count!r}")
    rng = random.Random(seed)
    seen: dict[str, None] = {}
    attempts = 0
    while len(seen) < count:
        attempts += 1
        if attempts > 50 * count:
            raise ValueError(f"grammar cannot produce {count} distinct sentences (got {len(seen)})")
        s = _sentence(rng)
        if MIN_CHARS <= len(s) <= MAX_CHARS:
            seen.setdefault(s)
    return list(seen)


def read_corpus(path: str | Path = CORPUS_PATH) -> list[str]:
    """Non-empty, stripped lines of a corpus file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file {str(path)!r} does not exist")
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


if __name__ == "__main__":
    CORPUS_PATH.parent.mkdir(parents=True, exist_ok=True)
    CORPUS_PATH.write_text("\n".join(generate_sentences()) + "\n", encoding="utf-8")
    print(f"wrote {DEFAULT_COUNT} sentences to {CORPUS_PATH}")
