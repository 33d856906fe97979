"""``bench blend-sim``'s flags, parsed: each malformed value is one usage error naming its flag.

Called by :func:`.blend_sim.command` only; torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

import click

SELECTIONS = ("deviation", "deep", "question", "window", "staged")
"""The selections of :mod:`.blend_sim` (its module doc), by the name before ``@``."""


def _ratio(part: str) -> float:
    value = float(part)
    if not 0.0 <= value <= 1.0:
        raise ValueError(part)
    return value


def _index_below(bound: int | None) -> Callable[[str], int]:
    """A converter for :func:`.e2e.parse_comma_list`: an integer in ``[0, bound)`` (any
    non-negative integer when ``bound`` is None), ValueError for anything else."""

    def index(part: str) -> int:
        value = int(part)
        if value < 0 or (bound is not None and value >= bound):
            raise ValueError(part)
        return value

    return index


def parse_ratios(text: str) -> list[float]:
    """``--ratios``: comma-separated fractions of the reused positions in [0, 1]. Raises
    :class:`click.BadParameter` naming the option for anything else."""
    from .e2e import parse_comma_list

    return parse_comma_list(text, "--ratios", _ratio, "a ratio (a number in [0, 1])")


def parse_check_layers(text: str, layers: int | None = None) -> list[int]:
    """``--check-layers``: comma-separated layer indices, each in ``[0, layers)`` (any
    non-negative integer while ``layers`` is None, before the model is read). Raises
    :class:`click.BadParameter` naming the option for anything else."""
    from .e2e import parse_comma_list

    bound = "a non-negative integer" if layers is None else f"0 to {layers - 1}"
    what = f"a layer of the model ({bound})"
    return parse_comma_list(text, "--check-layers", _index_below(layers), what)


def parse_selections(text: str) -> list[str]:
    """``--selections``: comma-separated names of :data:`SELECTIONS`. Raises
    :class:`click.BadParameter` naming the option for anything else."""
    from .e2e import parse_comma_list

    def name(part: str) -> str:
        if part not in SELECTIONS:
            raise ValueError(part)
        return part

    return parse_comma_list(text, "--selections", name, f"one of {', '.join(SELECTIONS)}")


def parse_group_indices(text: str, groups: int) -> set[int]:
    """``--only``: comma-separated group indices in ``[0, groups)``; empty: every group.
    Raises :class:`click.BadParameter` naming the option for anything else."""
    from .e2e import parse_comma_list

    if not text.strip():
        return set()
    what = f"a group index (0 to {groups - 1})"
    return set(parse_comma_list(text, "--only", _index_below(groups), what))


def parse_workloads(text: str) -> list[str]:
    """``--workloads``: comma-separated built-in workloads that have donors (not ``control``).
    Raises :class:`click.BadParameter` naming the option for anything else."""
    from .builtin_workloads import BUILTIN_WORKLOADS

    names = [n.strip() for n in text.split(",")]
    wrong = [n for n in names if n not in BUILTIN_WORKLOADS or n == "control"]
    if wrong:
        choices = ", ".join(n for n in BUILTIN_WORKLOADS if n != "control")
        raise click.BadParameter(
            f"not a workload with donors: {wrong} (one of {choices})", param_hint="'--workloads'"
        )
    return names
