"""Reports: markdown + PNG pages and Chrome/Perfetto traces from scenario runs.

``hkvsim report INPUT... [--out DIR]`` runs scenario files (or directories of them, or reads
saved ``hkvsim run|sweep --json --requests`` results, the shards of a sweep merged) and writes
``report.md``, its figures (per input), ``report.json`` (the same numbers, machine-readable),
``trace.json`` (every transfer) and, with ``--csv``, ``requests.csv``. Several inputs, or any
axis (``--compare``), are put side by side (:mod:`.axis`); ``[prefill] tokens_per_second``
adds the P/D sizing view (:mod:`.sizing`). A simulated report is a pure function of the inputs
and their seeds. matplotlib is imported only by :mod:`hkvsim.report.plots`, and only while a
report is written.
"""

from __future__ import annotations

from .build import FIGURES, build_report, collect, write_report
from .data import Variant, variant_from_result, variants_from_json
from .trace import trace_document

__all__ = ["FIGURES", "Variant", "build_report", "collect", "trace_document",
           "variant_from_result", "variants_from_json", "write_report"]
