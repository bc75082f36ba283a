"""Which variants of a scenario file a command runs, and running them in parallel.

``--shard i/n`` keeps the variants whose index in the file's sweep is ``i`` modulo ``n``
(0-based, round-robin, so neighbouring variants of similar cost land on different shards): any
job scheduler spreads a large sweep over ``n`` machines by giving each its index (a Slurm array's
``$SLURM_ARRAY_TASK_ID``, a Kubernetes indexed Job's ``$JOB_COMPLETION_INDEX``), and ``hkvsim
report`` merges the saved ``--json --requests`` outputs.

``--jobs N`` runs the selected variants in ``N`` child ``hkvsim sweep --json`` processes, each
given a round-robin slice of them. The children print JSON (the same ``result_json`` a serial run prints) and the parent reads
it back and orders it by variant index, so the output is the serial run's, byte for byte;
nothing crosses a process boundary but command lines and JSON text (no pickle).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

__all__ = ["SelectionError", "Shard", "parse_variant_list", "run_children", "split"]


class SelectionError(ValueError):
    """A bad --shard / --jobs / --variants value (one line: the flag, the value, what is
    allowed)."""


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0 <= index < count)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, sep, count = text.partition("/")
        try:
            shard = cls(int(index), int(count)) if sep else None
        except ValueError:
            shard = None
        if shard is None or not 0 <= shard.index < shard.count:
            raise SelectionError(f"--shard {text!r}: expected i/n with 0 <= i < n (e.g. 0/4 "
                                 f"for the first of four shards)")
        return shard

    def select(self, variants: int) -> list[int]:
        """Indices of this shard's variants among ``variants``."""
        return list(range(self.index, variants, self.count))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_variant_list(text: str, variants: int) -> list[int]:
    """``--variants 0,3,7`` (the children of ``--jobs``): indices below ``variants``."""
    try:
        out = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        out = []
    if not out or out[0] < 0 or out[-1] >= variants:
        raise SelectionError(f"--variants {text!r}: expected comma-separated variant indices "
                             f"from 0 to {variants - 1}")
    return out


def split(indices: Sequence[int], parts: int) -> list[list[int]]:
    """Round-robin split of ``indices`` into at most ``parts`` non-empty chunks."""
    parts = max(1, min(parts, len(indices)))
    return [list(indices[k::parts]) for k in range(parts)]


def _run_child(command: list[str]) -> dict[str, Any]:
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1):  # 1: an expectation not met, the JSON is still complete
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise SelectionError(last.removeprefix("hkvsim: error: "))
    return json.loads(proc.stdout)


def run_children(file: str, indices: Sequence[int], *, jobs: int, flags: Sequence[str],
                 on_chunk: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Run the variants ``indices`` of ``file`` in child ``hkvsim sweep --json`` processes,
    ``jobs`` at a time (``flags``: passed on, e.g. ``--timing-only``); returns their result
    JSON in variant order. A child that fails with a bad input raises :class:`SelectionError`
    with its one-line error."""
    # one child per job: a child's start (imports, 0.7-3 s of CPU) is paid once per job, and
    # the round-robin split already mixes cheap and costly neighbours of a sweep
    chunks = split(indices, jobs)
    commands = [[sys.executable, "-m", "hkvsim.cli", "sweep", file, "--json",
                 "--variants", ",".join(map(str, chunk)), *flags] for chunk in chunks]
    results: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run_child, c) for c in commands]
        try:
            for done in as_completed(futures):
                results += done.result()["scenarios"]
                if on_chunk is not None:
                    on_chunk()
        except BaseException:
            for f in futures:  # chunks not started yet are dropped; running ones finish
                f.cancel()
            raise
    return sorted(results, key=lambda d: d["sweep_index"])
