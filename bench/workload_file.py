"""User workloads as JSON Lines: ``python -m semblend_sglang.bench --workload FILE.jsonl``.

One JSON object per line (format and example: docs/bench-workloads.md)::

    {"group": "faq-1", "prompt": "...", "role": "donor", "reference": "...", "label": "..."}
    {"group": "faq-1", "input_ids": [1, 2, 3], "reference_ids": [4, 5]}

Keys: ``group`` (non-empty string, required); exactly one of ``prompt`` (non-empty string,
tokenized with the tokenizer's defaults, as SGLang tokenizes a text prompt) and ``input_ids``
(non-empty list of token ids); optional ``role`` (``"donor"`` or ``"probe"``; without it the
first line of a group is its donor and later lines are probes); optional ``reference`` (string,
tokenized without special tokens) or ``reference_ids`` (list of token ids), the continuation
teacher-forced for the PPL ratio; optional ``label`` (string); optional ``reordered_ids`` (list
of token ids: the probe rewritten with its passages in a donor's order, which the ``reorder``
system sends instead); optional ``passages`` (list of ``[start, end]`` token bounds, adjacent,
as a request declares them to the server, docs/sglang.md "Passage order"; the
``reorder_spans`` system sends such a probe with them declared). No other key is accepted.
Blank lines and lines whose first non-blank character is ``#`` are skipped.

Groups keep the order of their first line; a group's lines need not be adjacent. In a group the
donors must come before the probes and there must be at least one probe (a group with no donor
is a control group: its probes are misses). Every problem raises :class:`WorkloadFileError`
whose message starts with ``"{path}:{line}: "``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..passages import PassageError, parse_passages
from .metrics import percentile
from .workloads import BenchRequest, RequestGroup, Workload, encode

KEYS = frozenset(
    {
        "group",
        "prompt",
        "input_ids",
        "role",
        "reference",
        "reference_ids",
        "label",
        "reordered_ids",
        "passages",
    }
)


class WorkloadFileError(ValueError):
    """A workload file is malformed; ``path`` and ``line`` (1-based) say where."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = str(path)
        self.line = line


@dataclass
class _Group:
    first_line: int
    requests: list[BenchRequest] = field(default_factory=list)
    first_probe_line: int | None = None


class _Bad(Exception):
    """A problem with the current line (turned into a WorkloadFileError by the loader)."""


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Bad(f"duplicate key {key!r}")
        out[key] = value
    return out


def _vocab_size(tokenizer: Any) -> int | None:
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        return int(tokenizer.get_vocab_size())
    try:
        return len(tokenizer)  # transformers tokenizers (added tokens included)
    except TypeError:
        return None


def _token_ids(value: Any, key: str, vocab_size: int | None) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _Bad(f"{key!r} must be a list of token ids, not {type(value).__name__}")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise _Bad(f"{key!r}[{i}] must be an integer token id, not {item!r}")
        if item < 0 or (vocab_size is not None and item >= vocab_size):
            bound = f" (vocabulary size {vocab_size})" if vocab_size is not None else ""
            raise _Bad(f"{key!r}[{i}] = {item} is not a valid token id{bound}")
    return tuple(value)


def _text(obj: dict[str, Any], key: str, tokenizer: Any) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise _Bad(f"{key!r} must be a string, not {type(value).__name__}")
    if tokenizer is None:
        raise _Bad(f"a text {key!r} needs a tokenizer")
    return value


def _parse(text: str, tokenizer: Any, vocab: int | None) -> tuple[str, str | None, BenchRequest]:
    """(group, explicit role or None, request) of one non-blank, non-comment line."""
    try:
        obj = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as exc:
        raise _Bad(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise _Bad(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - KEYS)
    if unknown:
        raise _Bad(f"unknown key(s) {', '.join(map(repr, unknown))}; allowed: {sorted(KEYS)}")
    if "group" not in obj:
        raise _Bad("missing 'group'")
    group = obj["group"]
    if not isinstance(group, str) or not group:
        raise _Bad(f"'group' must be a non-empty string, not {group!r}")

    if ("prompt" in obj) == ("input_ids" in obj):
        raise _Bad("give exactly one of 'prompt' and 'input_ids'")
    if "prompt" in obj:
        prompt = _text(obj, "prompt", tokenizer)
        if not prompt:
            raise _Bad("'prompt' must not be empty")
        encoded = tokenizer.encode(prompt)  # the tokenizer's defaults, as SGLang encodes text
        prompt_ids = tuple(int(i) for i in getattr(encoded, "ids", encoded))
        if not prompt_ids:
            raise _Bad("'prompt' tokenizes to no tokens")
    else:
        prompt_ids = _token_ids(obj["input_ids"], "input_ids", vocab)
        if not prompt_ids:
            raise _Bad("'input_ids' must not be empty")

    if "reference" in obj and "reference_ids" in obj:
        raise _Bad("give at most one of 'reference' and 'reference_ids'")
    reference_ids: tuple[int, ...] = ()
    if "reference" in obj:
        reference_ids = encode(tokenizer, _text(obj, "reference", tokenizer))
    elif "reference_ids" in obj:
        reference_ids = _token_ids(obj["reference_ids"], "reference_ids", vocab)

    label = obj.get("label", "")
    if not isinstance(label, str):
        raise _Bad(f"'label' must be a string, not {type(label).__name__}")
    role = obj.get("role")
    if role is not None and role not in ("donor", "probe"):
        raise _Bad(f"unknown role {role!r} (use 'donor' or 'probe')")
    reordered_ids: tuple[int, ...] = ()
    if "reordered_ids" in obj:
        reordered_ids = _token_ids(obj["reordered_ids"], "reordered_ids", vocab)
    bounds: tuple[tuple[int, int], ...] = ()
    if "passages" in obj:
        try:
            bounds = parse_passages(obj["passages"], len(prompt_ids)).bounds
        except PassageError as exc:
            raise _Bad(f"'passages': {exc}") from None
    request = BenchRequest(
        prompt_ids,
        role or "probe",
        reference_ids,
        label,
        reordered_ids=reordered_ids,
        passage_bounds=bounds,
    )
    return group, role, request


def load_workload_file(path: str | Path, tokenizer: Any, name: str | None = None) -> Workload:
    """Read a JSONL workload; ``name`` defaults to the file's stem.

    ``tokenizer`` turns ``prompt``/``reference`` text into ids (transformers or
    ``tokenizers.Tokenizer``; may be None when every line uses ``input_ids``/``reference_ids``).
    ``context_tokens`` of the result is the median prompt length (rounded). Raises
    :class:`WorkloadFileError` naming the file and line for any problem (OSError if unreadable).
    """
    path = Path(path)
    vocab = _vocab_size(tokenizer)
    groups: dict[str, _Group] = {}
    line_no = 0
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8").strip()
                if not text or text.startswith("#"):
                    continue
                group, role, request = _parse(text, tokenizer, vocab)
                entry = groups.get(group)
                if entry is None:
                    entry = groups[group] = _Group(first_line=line_no)
                if role is None:  # default: the group's first line is its donor
                    role = "donor" if not entry.requests else "probe"
                    request = replace(request, role=role)
                if role == "donor" and entry.first_probe_line is not None:
                    raise _Bad(
                        f"donor after a probe in group {group!r} (probe on line "
                        f"{entry.first_probe_line}); a group's donors come first"
                    )
                if role == "probe" and entry.first_probe_line is None:
                    entry.first_probe_line = line_no
                entry.requests.append(request)
            except UnicodeDecodeError as exc:
                raise WorkloadFileError(
                    path, line_no, f"not UTF-8 ({exc.reason} at byte {exc.start})"
                ) from None
            except _Bad as exc:
                raise WorkloadFileError(path, line_no, str(exc)) from None

    if not groups:
        raise WorkloadFileError(path, max(line_no, 1), "no requests in the file")
    for group_id, entry in groups.items():
        if entry.first_probe_line is None:
            raise WorkloadFileError(
                path, entry.first_line, f"group {group_id!r} has no probe (only donors)"
            )
    built = tuple(RequestGroup(gid, tuple(e.requests)) for gid, e in groups.items())
    lengths = [len(r.prompt_ids) for g in built for r in g.requests]
    return Workload(
        name=name if name is not None else path.stem,
        context_tokens=round(percentile(lengths, 50)),
        groups=built,
    )


def write_workload_file(workload: Workload, path: str | Path) -> None:
    """Write ``workload`` as JSONL with ``input_ids`` (and explicit roles), so that
    :func:`load_workload_file` reads back the same groups and requests."""
    lines = []
    for group in workload.groups:
        for request in group.requests:
            obj: dict[str, Any] = {
                "group": group.group_id,
                "role": request.role,
                "input_ids": list(request.prompt_ids),
            }
            if request.reference_ids:
                obj["reference_ids"] = list(request.reference_ids)
            if request.label:
                obj["label"] = request.label
            if request.reordered_ids:
                obj["reordered_ids"] = list(request.reordered_ids)
            if request.passage_bounds:
                obj["passages"] = [list(b) for b in request.passage_bounds]
            lines.append(json.dumps(obj, ensure_ascii=False))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
