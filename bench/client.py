"""The bench's one HTTP client of an SGLang server: streamed greedy ``/generate`` (server-sent
events), teacher-forced reference logprobs and cold replays of an answer, ``/flush_cache``,
``/health_generate`` and semblend's ``GET /semblend/snapshot`` (its counters, and the settings
the server resolved).
Every bench job that talks to a server uses it.

Stream format (sglang 0.5.23, ``/generate`` with ``"stream": true``): lines ``data: {json}``, each
object carrying the ``text`` and ``meta_info`` so far (cumulative), then ``data: [DONE]``; blank
separator lines and any other line carry nothing. TTFT is the time from just before the request
is sent to the first chunk whose ``meta_info.completion_tokens`` is at least 1.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..passages import ORDER_INFO_KEY, PASSAGES_PARAM
from .metrics import input_logprobs_from_meta

DEFAULT_TIMEOUT_S = 600.0


class NoTokenStreamed(RuntimeError):
    """The stream ended without a chunk carrying an output token."""


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a stream's ``data:`` lines, in order, up to ``data: [DONE]`` (nothing
    after it is read); lines that do not start with ``data:`` are skipped. A ``data:`` line that
    is not JSON raises ``json.JSONDecodeError``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        body = line[len("data:") :].strip()
        if body == "[DONE]":
            return
        yield json.loads(body)


@dataclass(frozen=True)
class Streamed:
    """One streamed ``/generate`` answer: TTFT (seconds), the last ``meta_info`` and ``text`` read
    (the whole answer, or its first token's chunk when the stream was stopped there)."""

    ttft_s: float
    meta: dict[str, Any]
    text: str

    @property
    def completion_tokens(self) -> int:
        """Output tokens the server reported in the last chunk read."""
        return int(self.meta.get("completion_tokens", 0))


def stream_generate(
    url: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    return_logprob: bool = False,
    top_logprobs_num: int = 0,
    stop_after_first_token: bool = False,
    timeout: float = DEFAULT_TIMEOUT_S,
    custom_params: Mapping[str, Any] | None = None,
) -> Streamed:
    """Send one greedy streaming ``/generate`` of ``input_ids`` to the server at ``url`` and read
    the stream (see the module doc). ``return_logprob``: ask for output token logprobs (their ids
    are in ``meta["output_token_logprobs"]``); with ``top_logprobs_num`` > 0 also that many most
    likely tokens at every output position (``meta["output_top_logprobs"]``).
    ``stop_after_first_token``: close the stream at
    the first token (SGLang then aborts the request). ``custom_params``: sent as the sampling
    params' ``custom_params`` when given. Raises :class:`NoTokenStreamed` when no chunk carried
    a token, ``httpx.HTTPStatusError`` on an error status."""
    import httpx

    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    if custom_params is not None:
        sampling["custom_params"] = dict(custom_params)
    payload: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": sampling,
        "stream": True,
    }
    if return_logprob:
        payload["return_logprob"] = True
        if top_logprobs_num > 0:
            payload["top_logprobs_num"] = top_logprobs_num
    ttft: float | None = None
    meta: dict[str, Any] = {}
    text = ""
    start = time.perf_counter()
    with httpx.stream("POST", url + "/generate", json=payload, timeout=timeout) as resp:
        resp.raise_for_status()
        for chunk in sse_events(resp.iter_lines()):
            meta = chunk.get("meta_info", meta)
            text = chunk.get("text", text)
            if ttft is None and int(meta.get("completion_tokens", 0)) >= 1:
                ttft = time.perf_counter() - start
                if stop_after_first_token:
                    break
    if ttft is None:
        raise NoTokenStreamed(f"no token streamed back from {url}/generate")
    return Streamed(ttft_s=ttft, meta=meta, text=text)


def _teacher_forced_meta(
    url: str,
    prompt: Sequence[int],
    continuation: Sequence[int],
    timeout: float,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """``meta_info`` of one non-streamed ``/generate`` of ``prompt + continuation`` asking for
    the input logprobs from the prompt's last token on (``cache_salt``: sent when given)."""
    import httpx

    payload: dict[str, Any] = {
        "input_ids": list(prompt) + list(continuation),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 1,
    }
    if cache_salt is not None:
        payload["cache_salt"] = cache_salt
    resp = httpx.post(url + "/generate", json=payload, timeout=timeout)
    resp.raise_for_status()
    meta: dict[str, Any] = resp.json()["meta_info"]
    return meta


def reference_logprobs(
    url: str,
    prompt: Sequence[int],
    reference: Sequence[int],
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[float]:
    """Natural-log probabilities of ``reference`` teacher-forced after ``prompt`` (SGLang's input
    logprobs; format: :func:`.metrics.input_logprobs_from_meta`). ``prompt`` must not be empty."""
    meta = _teacher_forced_meta(url, prompt, reference, timeout)
    return input_logprobs_from_meta(meta, len(reference), reference)


def cold_replay_logprobs(
    url: str,
    prompt: Sequence[int],
    answer: Sequence[int],
    timeout: float = DEFAULT_TIMEOUT_S,
) -> list[float]:
    """:func:`reference_logprobs` of ``answer`` after ``prompt`` computed cold, whatever the
    server holds: the request carries a ``cache_salt`` of its own (uuid4), a namespace in which
    neither SGLang's prefix cache nor semblend's donors hold anything. The replay half of
    SGLang's KL measure (:func:`.metrics.kl_divergence`); it needs no flush."""
    salt = f"kl-replay-{uuid.uuid4().hex}"
    meta = _teacher_forced_meta(url, prompt, answer, timeout, cache_salt=salt)
    if int(meta.get("cached_tokens", 0)):
        raise RuntimeError(f"a cold replay reused {meta['cached_tokens']} cached tokens")
    return input_logprobs_from_meta(meta, len(answer), answer)


def try_flush(url: str) -> bool:
    """Ask once for ``/flush_cache``: True when SGLang emptied its radix cache, False when it
    refused (it flushes only while no request runs). Transport errors raise ``httpx.HTTPError``."""
    import httpx

    return httpx.post(url + "/flush_cache", timeout=60.0).status_code == 200


def flush_cache(url: str, attempts: int = 50, interval_s: float = 0.2) -> None:
    """Empty the server's radix cache, asking up to ``attempts`` times ``interval_s`` apart while
    requests still run; RuntimeError when it never did."""
    for i in range(attempts):
        if try_flush(url):
            return
        if i + 1 < attempts:
            time.sleep(interval_s)
    raise RuntimeError(f"{url}/flush_cache refused {attempts} times")


def semblend_state(url: str) -> dict[str, Any] | None:
    """The whole ``GET /semblend/snapshot`` answer: ``ranks`` (each scheduler's counters),
    ``total`` (summed) and ``config`` (the first scheduler's resolved settings, absent or None
    on an older server), or None when the server has no semblend route (a vanilla server).
    Another error status raises ``httpx.HTTPStatusError``."""
    import httpx

    resp = httpx.get(url + "/semblend/snapshot", timeout=60.0)
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    state: dict[str, Any] = resp.json()
    return state


def semblend_snapshot(url: str) -> dict[str, Any] | None:
    """semblend's counters summed over the server's schedulers (``GET /semblend/snapshot``,
    ``total``), or None when the server has no semblend route (a vanilla server)."""
    state = semblend_state(url)
    if state is None:
        return None
    total: dict[str, Any] = state["total"]
    return total


def semblend_config(url: str) -> dict[str, Any] | None:
    """The settings the server's first scheduler resolved (``GET /semblend/snapshot``,
    ``config``: ``Config.as_dict()``, e.g. ``recompute_strategy``), or None when the server has
    no semblend route (vanilla) or reports no config (an older semblend server)."""
    state = semblend_state(url)
    config = None if state is None else state.get("config")
    return dict(config) if isinstance(config, dict) else None


def health_generate(url: str, timeout: float = 120.0) -> bool:
    """True when ``GET /health_generate`` (one real forward) answers 200; False on another status
    or a transport error."""
    import httpx

    try:
        return httpx.get(url + "/health_generate", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def top2_margins(meta: dict[str, Any]) -> tuple[float, ...]:
    """Per output position of a ``/generate`` answer asked with ``top_logprobs_num`` >= 2: the
    logprob of its most likely token minus that of its second (``output_top_logprobs`` entries
    are ``[logprob, token_id, text]``, most likely first). Raises ValueError on a position with
    fewer than two entries."""
    out = []
    for i, top in enumerate(meta.get("output_top_logprobs") or []):
        if top is None or len(top) < 2:
            got = 0 if top is None else len(top)
            raise ValueError(f"output position {i} has {got} top logprobs")
        out.append(float(top[0][0]) - float(top[1][0]))
    return tuple(out)


@dataclass(frozen=True)
class Answer:
    """One streamed greedy ``/generate`` answer: TTFT, the server's prompt and cached-token
    counts, the output token ids, their logprobs as the server gave them (``output_logprobs``)
    and the text, and (when asked for) ``margins``: per output position, the logprob of the most
    likely token minus that of the second."""

    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    output_ids: tuple[int, ...]
    text: str
    margins: tuple[float, ...] = ()
    output_logprobs: tuple[float, ...] = ()
    passage_order: tuple[int, ...] = ()
    """The order the server put declared passages in (``meta_info``'s
    ``semblend_passage_order``); empty when none were declared."""


class ServerClient:
    """The functions of this module bound to one server ``url`` (trailing ``/`` dropped)."""

    def __init__(self, url: str, timeout: float = 900.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        *,
        margins: bool = False,
        passages: Sequence[tuple[int, int]] = (),
    ) -> Answer:
        """Greedy streamed generation with output ids (:func:`stream_generate`); ``margins``:
        also the top-1 / top-2 logprob margin of every output position; ``passages``: declared
        as reorderable (``custom_params.semblend_passages``, docs/sglang.md)."""
        got = stream_generate(
            self.url,
            input_ids,
            max_new_tokens,
            return_logprob=True,
            top_logprobs_num=2 if margins else 0,
            timeout=self.timeout,
            custom_params={PASSAGES_PARAM: [list(b) for b in passages]} if passages else None,
        )
        entries = got.meta.get("output_token_logprobs") or []
        ids = tuple(int(entry[1]) for entry in entries)
        return Answer(
            ttft_s=got.ttft_s,
            prompt_tokens=int(got.meta.get("prompt_tokens", len(input_ids))),
            cached_tokens=int(got.meta.get("cached_tokens", 0)),
            output_ids=ids,
            text=got.text,
            margins=top2_margins(got.meta) if margins else (),
            output_logprobs=tuple(float(entry[0]) for entry in entries),
            passage_order=tuple(int(i) for i in got.meta.get(ORDER_INFO_KEY) or ()),
        )

    def reference_logprobs(self, prompt: Sequence[int], reference: Sequence[int]) -> list[float]:
        """:func:`reference_logprobs` on this server."""
        return reference_logprobs(self.url, prompt, reference, self.timeout)

    def cold_replay_logprobs(self, prompt: Sequence[int], answer: Sequence[int]) -> list[float]:
        """:func:`cold_replay_logprobs` on this server."""
        return cold_replay_logprobs(self.url, prompt, answer, self.timeout)

    def flush(self) -> None:
        """:func:`flush_cache` on this server."""
        flush_cache(self.url)

    def snapshot(self) -> dict[str, Any] | None:
        """:func:`semblend_snapshot` of this server."""
        return semblend_snapshot(self.url)

    def config(self) -> dict[str, Any] | None:
        """:func:`semblend_config` of this server."""
        return semblend_config(self.url)
