"""Request traces replayed as workloads: arrival times, prompt lengths and prefix hits.

Two formats, told apart by the file's suffix:

* ``.jsonl``, the **Mooncake** trace format: one JSON object per line with exactly the keys
  ``timestamp`` (arrival, milliseconds, a number >= 0, non-decreasing), ``input_length`` (prompt
  tokens, an integer >= 2), ``output_length`` (an integer >= 0; read and checked, not used: hkvsim
  moves the prompt's KV and state, decode's output does not enter the transfer) and ``hash_ids``
  (one non-negative integer per 512-token block of the prompt, ``ceil(input_length / 512)`` of
  them; equal ids mean equal blocks, so shared leading ids are a shared prefix).
* ``.csv``: a header line ``arrival_s,prompt_tokens,prefix_hit_tokens`` then one request per
  line: arrival in seconds (a number >= 0, non-decreasing), prompt tokens (an integer >= 2) and
  the prefix hit in tokens (an integer >= 0 and below the prompt length).

Blank lines are skipped in both. Arrivals are replayed relative to the first request (it arrives
at 0 s). Every problem raises :class:`TraceError`, one line naming the file, the line number and
the field: ``trace.jsonl:7: hash_ids: expected 3 ids (ceil(1200 / 512)), got 2``.

**Prefix hits of a Mooncake trace (the cache model).** Decode's prefix cache is modelled as
unbounded and shared by every decode instance: it holds every block id of every earlier request
(file order; requests with equal timestamps in line order) and never evicts. A request's hit is
the leading run of its ``hash_ids`` that earlier requests already had, times 512 tokens, capped at
``input_length - 1`` (decode always computes the last prompt token itself). Ids repeated inside
one request do not hit. The hit is then reused in whole logical blocks of decode, like any
requested hit (hkvsim.workload).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "CSV_HEADER",
    "MOONCAKE_BLOCK_TOKENS",
    "MOONCAKE_KEYS",
    "TRACE_FORMATS",
    "Trace",
    "TraceError",
    "load_trace",
    "mooncake_prefix_hits",
]

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
CSV_HEADER = ("arrival_s", "prompt_tokens", "prefix_hit_tokens")
TRACE_FORMATS = {".jsonl": "mooncake", ".csv": "csv"}


class TraceError(ValueError):
    """A trace file that cannot be replayed: ``<file>:<line>: <field>: <problem>``."""

    def __init__(self, path: str | Path, problem: str, *, line: int | None = None,
                 field: str | None = None) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        text = ": ".join(part for part in (where, field, problem) if part)
        super().__init__(" ".join(text.splitlines()))


@dataclass(frozen=True, eq=False)
class Trace:
    """One replayable trace: per request, arrival (s, first = 0), prompt and prefix-hit tokens.

    The arrays are read-only (a loaded trace is cached and shared)."""

    path: str
    format: str  # "mooncake" | "csv"
    arrival_seconds: NDArray[np.float64]
    prompt_tokens: NDArray[np.int64]
    prefix_hit_tokens: NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (their hits and arrivals do not depend on later ones)."""
        if not 1 <= n <= len(self):
            raise ValueError(f"n must be from 1 to {len(self)}, got {n}")
        return Trace(path=self.path, format=self.format, arrival_seconds=self.arrival_seconds[:n],
                     prompt_tokens=self.prompt_tokens[:n],
                     prefix_hit_tokens=self.prefix_hit_tokens[:n])


def mooncake_prefix_hits(hash_ids: list[list[int]], prompt_tokens: NDArray[np.int64],
                         block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> NDArray[np.int64]:
    """Prefix-hit tokens per request under the cache model of the module docstring."""
    seen: set[int] = set()
    runs = np.zeros(len(hash_ids), dtype=np.int64)
    for i, ids in enumerate(hash_ids):
        run = 0
        while run < len(ids) and ids[run] in seen:
            run += 1
        runs[i] = run
        seen.update(ids)
    return np.minimum(runs * block_tokens, np.asarray(prompt_tokens, dtype=np.int64) - 1)


def load_trace(path: str | Path, *, max_tokens: int, max_requests: int) -> Trace:
    """Read and validate a trace file (format from its suffix); cached per file version."""
    file = Path(path)
    fmt = TRACE_FORMATS.get(file.suffix.lower())
    if fmt is None:
        raise TraceError(file, f"unknown trace format {file.suffix or '(no suffix)'!r}; "
                               f"allowed: {', '.join(TRACE_FORMATS)} (Mooncake JSONL, CSV)")
    try:
        stat = file.stat()
    except OSError as exc:
        raise TraceError(file, f"cannot read trace: {exc.strerror or exc}") from None
    return _load(str(file), fmt, stat.st_mtime_ns, stat.st_size, max_tokens, max_requests)


@functools.lru_cache(maxsize=16)
def _load(path: str, fmt: str, _mtime_ns: int, _size: int, max_tokens: int,
          max_requests: int) -> Trace:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise TraceError(path, f"cannot read trace: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(path, f"not UTF-8 text: {exc}") from None
    reader = _Mooncake if fmt == "mooncake" else _Csv
    arrivals, prompts, hits = reader(path, max_tokens, max_requests).read(text)
    for array in (arrivals, prompts, hits):
        array.setflags(write=False)
    return Trace(path=path, format=fmt, arrival_seconds=arrivals, prompt_tokens=prompts,
                 prefix_hit_tokens=hits)


class _Reader:
    """Line-by-line validation shared by both formats."""

    def __init__(self, path: str, max_tokens: int, max_requests: int) -> None:
        self.path = path
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.line = 0
        self.arrivals: list[float] = []
        self.prompts: list[int] = []

    def fail(self, field: str | None, problem: str) -> TraceError:
        return TraceError(self.path, problem, line=self.line or None, field=field)

    def integer(self, field: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(field, f"expected an integer, got {_show(value)}")
        if not low <= value <= high:
            raise self.fail(field, f"expected an integer from {low} to {high}, got {value}")
        return value

    def arrival(self, field: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(field, f"expected a number, got {_show(value)}")
        if not math.isfinite(value) or value < 0:
            raise self.fail(field, f"expected a finite number >= 0, got {value}")
        if self.arrivals and value < self.arrivals[-1]:
            raise self.fail(field, f"arrivals must not decrease: {float(value)} after "
                                   f"{self.arrivals[-1]} on an earlier line")
        return float(value)

    def prompt(self, field: str, value: Any) -> int:
        return self.integer(field, value, 2, self.max_tokens)

    def count(self) -> None:
        if len(self.prompts) >= self.max_requests:
            raise self.fail(None, f"more than {self.max_requests} requests")

    def lines(self, text: str) -> Any:
        for self.line, raw in enumerate(text.splitlines(), start=1):
            if raw.strip():
                yield raw

    def finish(self) -> None:
        if not self.prompts:
            self.line = 0
            raise self.fail(None, "no requests in the trace")


class _Mooncake(_Reader):
    def read(self, text: str) -> tuple[NDArray[np.float64], NDArray[np.int64],
                                       NDArray[np.int64]]:
        ids_per_request: list[list[int]] = []
        for raw in self.lines(text):
            self.count()
            try:
                obj = json.loads(raw, object_pairs_hook=self._no_duplicates,
                                 parse_constant=self._no_constant)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise self.fail(None, f"not a JSON object: {exc}") from None
            if not isinstance(obj, dict):
                raise self.fail(None, f"expected a JSON object, got {_show(obj)}")
            unknown = [k for k in obj if k not in MOONCAKE_KEYS]
            if unknown:
                raise self.fail(unknown[0], f"unknown key; allowed: {', '.join(MOONCAKE_KEYS)}")
            missing = [k for k in MOONCAKE_KEYS if k not in obj]
            if missing:
                raise self.fail(missing[0], "required key is missing")
            arrival_ms = self.arrival("timestamp", obj["timestamp"])
            prompt = self.prompt("input_length", obj["input_length"])
            self.integer("output_length", obj["output_length"], 0, self.max_tokens)
            ids = obj["hash_ids"]
            if not isinstance(ids, list):
                raise self.fail("hash_ids", f"expected a list of integers, got {_show(ids)}")
            expected = -(-prompt // MOONCAKE_BLOCK_TOKENS)
            if len(ids) != expected:
                raise self.fail("hash_ids", f"expected {expected} ids (one per "
                                            f"{MOONCAKE_BLOCK_TOKENS}-token block of "
                                            f"input_length {prompt}), got {len(ids)}")
            for k, block in enumerate(ids):
                self.integer(f"hash_ids[{k}]", block, 0, 2**63 - 1)
            self.arrivals.append(arrival_ms)
            self.prompts.append(prompt)
            ids_per_request.append(ids)
        self.finish()
        prompts = np.asarray(self.prompts, dtype=np.int64)
        arrivals = np.asarray(self.arrivals, dtype=np.float64)
        return ((arrivals - arrivals[0]) / 1e3, prompts,
                mooncake_prefix_hits(ids_per_request, prompts))

    def _no_duplicates(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise self.fail(key, "key given twice")
            out[key] = value
        return out

    def _no_constant(self, name: str) -> Any:
        raise self.fail(None, f"not a JSON number: {name}")


class _Csv(_Reader):
    def read(self, text: str) -> tuple[NDArray[np.float64], NDArray[np.int64],
                                       NDArray[np.int64]]:
        hits: list[int] = []
        rows = self.lines(text)
        header = next(rows, None)
        if header is None:
            self.line = 0
            raise self.fail(None, f"empty file; expected the header {','.join(CSV_HEADER)}")
        if tuple(c.strip() for c in header.split(",")) != CSV_HEADER:
            raise self.fail(None, f"expected the header {','.join(CSV_HEADER)}, got "
                                  f"{_show(header)}")
        for raw in rows:
            self.count()
            (cells,) = csv.reader(io.StringIO(raw))
            if len(cells) != len(CSV_HEADER):
                raise self.fail(None, f"expected {len(CSV_HEADER)} fields "
                                      f"({','.join(CSV_HEADER)}), got {len(cells)}")
            arrival = self.arrival(CSV_HEADER[0], _number(cells[0]))
            prompt = self.prompt(CSV_HEADER[1], _number(cells[1]))
            hit = self.integer(CSV_HEADER[2], _number(cells[2]), 0, self.max_tokens)
            if hit >= prompt:
                raise self.fail(CSV_HEADER[2], f"a hit must leave at least one token to "
                                               f"prefill: {hit} >= prompt_tokens {prompt}")
            self.arrivals.append(arrival)
            self.prompts.append(prompt)
            hits.append(hit)
        self.finish()
        arrivals = np.asarray(self.arrivals, dtype=np.float64)
        return (arrivals - arrivals[0], np.asarray(self.prompts, dtype=np.int64),
                np.asarray(hits, dtype=np.int64))


def _number(cell: str) -> Any:
    """A CSV cell as an int, else a float, else the text (which the field check then refuses)."""
    text = cell.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
