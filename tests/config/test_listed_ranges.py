"""What ``--list_config`` says a setting may hold is what the setting's check lets through.

Each setting states its range once, on its field (``jaxrl_orch.settings.setting``): its
section's check and the listing both read it. These tests read the listing as a user does, find
the checked settings by probing the sections with bad values (so a check declared elsewhere
shows up), and try each stated bound: the value at it accepted, the one just past it refused,
naming both.
"""

from __future__ import annotations

import dataclasses

import pytest

from jaxrl_orch.config.listing import format_config_listing
from jaxrl_orch.config.load import SECTION_BY_NAME, SECTIONS, load_config
from jaxrl_orch.settings import Allowed, allowed_of

Engine, Trainer, Warmup, Loss = (
    SECTION_BY_NAME[n] for n in ("Engine", "Trainer", "Warmup", "Loss")
)

# Settings checked outside their section's ALLOWED table, so ``--list_config`` states no range
# for them: none today (a check added outside a table shows up here).
UNLISTED: set[str] = set()
# Settings set together: a value of one is tried with the other set too (MIS: a level and its
# band), so what is refused is the value itself.
COMPANIONS = {
    "mis_bounds": {"mis": "token"},
    "mis": {"mis_bounds": (0.5, 2.0)},
    "norm_constant": {"norm": "constant"},
    "quantize": {"rank": 4},
}
PROBES = (-(10**9), -1, 0, 0.5, 10**9, "no-such-value", None)


def _rules() -> list[tuple[type, str, Allowed]]:
    return [
        (s, f.name, rule)
        for s in SECTIONS
        for f in dataclasses.fields(s)
        if (rule := allowed_of(f)) is not None
    ]


def _checked(section: type, name: str) -> bool:
    """Whether some probe value is refused with a message naming ``Section.name``."""
    for value in PROBES:
        try:
            message = _refusal(section, name, value)
        except (TypeError, AttributeError):  # a check that compares before it looks
            continue
        if message is not None and message.startswith(f"{section.SECTION}.{name} must be"):
            return True
    return False


def _refusal(section: type, name: str, value) -> str | None:
    """The message of the ``ValueError`` that setting ``name`` to ``value`` raises (without the
    line gin adds naming the configurable), or None."""
    both = {} if value is None else COMPANIONS.get(name, {})
    try:
        dataclasses.replace(section(), **both, **{name: value})
    except ValueError as exc:
        return str(exc).splitlines()[0]
    return None


def _listed() -> dict[str, str]:
    """``{Section.name: the text after 'allowed: '}`` read from the listing's lines."""
    out, current = {}, None
    for line in format_config_listing().splitlines():
        if line.startswith("  ") and not line.startswith("   ") and " = " in line:
            current = line.split(":")[0].strip()
        elif line.startswith("    allowed: "):
            out[current] = line.removeprefix("    allowed: ")
    return out


def test_every_checked_setting_lists_what_its_check_allows():
    listed = _listed()
    checked = {
        f"{s.SECTION}.{f.name}"
        for s in SECTIONS
        for f in dataclasses.fields(s)
        if _checked(s, f.name)
    }
    tabled = {f"{s.SECTION}.{name}" for s, name, _ in _rules()}
    assert tabled <= checked  # no table entry without a check
    assert checked - tabled == UNLISTED  # and no other check but those known
    assert {k: listed[k] for k in tabled} == {
        f"{s.SECTION}.{name}": str(rule) for s, name, rule in _rules()
    }
    assert set(listed) == tabled  # nothing unchecked claims a range
    assert listed["Engine.serve_port"] == "in [0, 65535] or None"
    assert listed["Warmup.learning_rate"] == "> 0"
    assert listed["Model.remat"] == "one of ('none', 'full', 'dots', 'dots_no_batch')"


def _just_past(section: type, name: str, bound: float, step: int) -> float:
    is_int = next(f for f in dataclasses.fields(section) if f.name == name).type.startswith("int")
    return bound + step * (1 if is_int else 1e-6)


@pytest.mark.parametrize("section, name, rule", _rules(), ids=lambda x: getattr(x, "SECTION", x))
def test_the_value_at_each_listed_bound_passes_and_one_past_it_is_refused(section, name, rule):
    where = f"{section.SECTION}.{name}"
    accepted, refused = [], []
    if rule.subset:
        first, second = rule.choices[:2]
        accepted += [rule.choices, (first,), (second, first)]
        refused += [(), (first, first), (first, "no-such-value"), first, None]
    elif rule.choices is not None:
        accepted += list(rule.choices)
        refused.append("no-such-value")
    elif rule.band:
        accepted += [(0, 1), (0.5, 2.0)]
        refused += [(1.0, 1.0), (2.0, 0.5), (-0.5, 2.0), (0.5, 1.0, 2.0), "0.5, 2"]
        (accepted if rule.none_ok else refused).append(None)
    else:
        if rule.low_open:
            refused.append(rule.low)
            accepted.append(_just_past(section, name, rule.low, +1))
        else:
            accepted.append(rule.low)
            refused.append(_just_past(section, name, rule.low, -1))
        if rule.high is not None:
            accepted.append(rule.high)
            refused.append(_just_past(section, name, rule.high, +1))
        (accepted if rule.none_ok else refused).append(None)
    for value in accepted:
        assert _refusal(section, name, value) is None, (where, value)
    why = f": {rule.why}" if rule.why else ""
    for value in refused:
        assert _refusal(section, name, value) == f"{where} must be {rule}, got {value!r}{why}"


def test_a_setting_declared_int_refuses_a_fraction_or_a_bool():
    assert _refusal(Engine, "slots", 1.5) == "Engine.slots must be an int, got 1.5"
    assert _refusal(Warmup, "steps", True) == "Warmup.steps must be an int, got True"
    assert (
        _refusal(Trainer, "rows_per_batch", 8.0) == "Trainer.rows_per_batch must be an int, got 8.0"
    )
    assert _refusal(Trainer, "rows_per_batch", None) is None
    assert _refusal(Engine, "max_target_length", 1) == (
        "Engine.max_target_length must be >= 2, got 1: a prompt token and a generated one"
    )
    with pytest.raises(ValueError, match=r"Engine.serve_port must be in \[0, 65535\] or None, got"):
        load_config([], ["Engine.serve_port = 70000"])  # through a gin binding, before any work


def _float_settings() -> list[tuple[type, str]]:
    return [
        (s, f.name)
        for s in SECTIONS
        for f in dataclasses.fields(s)
        if f.type.startswith("float") and not (allowed_of(f) and allowed_of(f).infinite_ok)
    ]


@pytest.mark.parametrize("section, name", _float_settings(), ids=str)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=str)
def test_every_float_setting_refuses_what_is_not_finite(section, name, value):
    assert (
        _refusal(section, name, value) == f"{section.SECTION}.{name} must be finite, got {value!r}"
    )


def test_only_settings_that_say_so_take_infinity():
    assert _refusal(Loss, "tis_cap", float("inf")) is None  # uncapped TIS, as the listing says
    assert "or inf" in _listed()["Loss.tis_cap"]
    with pytest.raises(ValueError, match="RL.temperature must be finite, got inf"):
        load_config([], ["RL.temperature = 1e999"])
    with pytest.raises(ValueError, match="Loss.kl_beta must be finite, got inf"):
        load_config([], ["Loss.kl_beta = 1e999"])
