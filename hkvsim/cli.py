"""``hkvsim``: plan, run and sweep P/D KV-transfer scenarios.

Exit status: 0 when every scenario's [expect] is met, 1 when one is not, 2 on bad input (one
clear error line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

EXIT_OK, EXIT_EXPECTATION, EXIT_INPUT = 0, 1, 2


def _input_errors() -> tuple[type[BaseException], ...]:
    from .connector.tp import TPError
    from .fabric import PlacementError, ProfileError
    from .fabric.links import FabricError
    from .geometry.specs import GeometryError
    from .scenario import ScenarioError

    return (ScenarioError, GeometryError, ProfileError, PlacementError, FabricError, TPError)


def _load(path: str) -> list[Any]:
    from .scenario import load_scenarios

    return load_scenarios(path)


def _emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def _console() -> Any:
    from rich.console import Console

    # a pipe or a CI log gets a wide, stable layout instead of rich's 80-column default
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _progress(items: Sequence[Any], label: str) -> Any:
    """Iterate with a progress bar on a terminal (stderr), silently otherwise."""
    if len(items) < 2 or not sys.stderr.isatty():
        yield from items
        return
    from rich.progress import track

    yield from track(items, description=label, console=None, transient=True)


# ---- plan --------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import plan_scenario

    plans = [plan_scenario(s) for s in _progress(_load(args.file), "planning")]
    if args.json:
        _emit_json(plans[0] if len(plans) == 1 else plans)
        return EXIT_OK
    console = _console()
    for plan in plans:
        _print_plan(console, plan)
    return EXIT_OK


def _print_plan(console: Any, plan: dict[str, Any]) -> None:
    from rich.table import Table

    console.rule(f"[bold]{plan['scenario']}[/] ({plan['model']}, {plan['mode']}, "
                 f"fabric {plan['fabric']})")
    table = Table("", "prefill", "decode", title="resolved geometry (per rank)")
    rows = [("TP", "tp"), ("instances", "instances"), ("kernel block (tokens)", "kernel_block_size"),
            ("logical block (tokens)", "logical_block_size"),
            ("physical blocks per logical", "physical_blocks_per_logical"),
            ("logical blocks", "num_logical_blocks"), ("attention kernel page (B)",
                                                       "attention_page_bytes"),
            ("state page (B)", "state_page_bytes"), ("unified page (B)", "unified_page_bytes"),
            ("KV bytes per token", "kv_bytes_per_token"),
            ("state bytes per request", "state_bytes_per_request")]
    for label, key in rows:
        table.add_row(label, f"{plan['prefill'][key]:,}", f"{plan['decode'][key]:,}")
    for role in ("prefill", "decode"):
        regions = plan[role]["regions"]
        mla = sum(r["is_mla"] for r in regions)
        lens = sorted({r["block_len"] for r in regions})
        table.add_row(f"regions ({role})" if role == "prefill" else "regions (decode)",
                      *([f"{len(regions)} ({mla} MLA), block_len {lens}", ""] if role == "prefill"
                        else ["", f"{len(regions)} ({mla} MLA), block_len {lens}"]))
    console.print(table)
    hs = plan["handshake"]
    console.print("handshake: " + ("[green]ok[/]" if hs["ok"] else f"[red]refused[/]: {hs['error']}"))
    reqs = plan["requests"]
    if reqs:
        t = Table("request", "prompt", "hit asked", "hit reused", "descriptors", "bytes",
                  "transfers", "predicted transfer", title="planned requests")
        for r in reqs[:20]:
            pred = r.get("predicted_transfer_seconds")
            reused = r["effective_prefix_hit_tokens"]
            t.add_row(str(r["index"]), f"{r['prompt_tokens']:,}", f"{r['prefix_hit_tokens']:,}",
                      "-" if reused is None else f"{reused:,}",
                      f"{r['descriptors']:,}", f"{r['bytes']:,}", str(r["transfers"]),
                      f"{pred * 1e3:.3f} ms" if pred is not None else r.get("error", "-"))
        if len(reqs) > 20:
            t.caption = f"first 20 of {len(reqs)} requests"
        console.print(t)


# ---- run / sweep -------------------------------------------------------------------------------
def _run_all(args: argparse.Namespace) -> list[Any]:
    from .cluster import run_scenario

    if args.backend == "nixl":  # real NIXL, one process per rank (hkvsim/backends)
        from .drivers.nixl import run_for_cli

        return run_for_cli(_load(args.file), timing_only=args.timing_only, progress=_progress)
    scenarios = _load(args.file)
    return [run_scenario(s, timing_only=args.timing_only)
            for s in _progress(scenarios, "running")]


def cmd_run(args: argparse.Namespace) -> int:
    from .results import result_json

    results = _run_all(args)
    data = [result_json(r, requests=args.requests) for r in results]
    met = all(d["expectation_met"] for d in data)
    if args.json:
        _emit_json(data[0] if len(data) == 1 else {"scenarios": data, "expectation_met": met})
    else:
        console = _console()
        for d in data:
            _print_result(console, d)
    return EXIT_OK if met else EXIT_EXPECTATION


def _print_result(console: Any, d: dict[str, Any]) -> None:
    req = d["requests"]
    status = "[green]expectation met[/]" if d["expectation_met"] else "[red]EXPECTATION NOT MET[/]"
    console.rule(f"[bold]{d['scenario']}[/]")
    console.print(f"outcome [bold]{d['outcome']}[/] - {status}")
    console.print(f"requests: {req['completed']}/{req['total']} completed, {req['failed']} failed, "
                  f"{req['hung']} hung; byte-exact: {req['byte_exact']}; mismatched bytes: "
                  f"{req['mismatched_bytes']:,}")
    console.print(f"moved {req['bytes']:,} B in {req['descriptors']:,} descriptors over "
                  f"{req['transfers']:,} transfers; leaks {d['leaks']}")
    t = d["time"]
    if t["transfer_seconds"]:
        ts = t["transfer_seconds"]
        console.print(f"transfer time p50 {ts['p50'] * 1e3:.3f} ms, p99 {ts['p99'] * 1e3:.3f} ms; "
                      f"simulated {t['simulated_seconds']:.3f} s")
    for line in d["handshake_errors"][:3]:
        console.print(f"[red]handshake:[/] {line}")
    for f in d["failures"][:3]:
        console.print(f"[red]request {f['request']} failed[/] ({f['class']}): {f['reason']}")
    for m in d["mismatches"][:5]:
        console.print(f"[red]mismatch:[/] {m}")
    for p in d["expectation_problems"]:
        console.print(f"[red]expectation:[/] {p}")


def cmd_sweep(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .results import result_json, summary_row

    results = _run_all(args)
    met = all(not result_json(r)["expectation_problems"] for r in results)
    if args.json:
        _emit_json({"scenarios": [result_json(r) for r in results], "expectation_met": met})
        return EXIT_OK if met else EXIT_EXPECTATION
    rows = [summary_row(r) for r in results]
    title = results[0].scenario.scenario.name.split(" [")[0] if results else ""
    table = Table("variant", "outcome", "expect", "requests", "mismatched B", "descriptors",
                  "transfer p50", title=f"{title}: {len(rows)} variant(s)")
    for row, result in zip(rows, results):
        point = result.scenario.sweep_point
        label = ", ".join(f"{k}={v}" for k, v in point.items()) if point else row["scenario"]
        table.add_row(label, row["outcome"],
                      "[green]met[/]" if row["met"] else "[red]NOT MET[/]", row["requests"],
                      f"{row['mismatched_bytes']:,}", f"{row['descriptors']:,}",
                      f"{row['transfer_p50_ms']:.3f} ms")
    _console().print(table)
    return EXIT_OK if met else EXIT_EXPECTATION


# ---- report ------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from .report import build_report

    command = ["hkvsim", "report", *args.inputs]
    for flag, value in (("--out", args.out), ("--title", args.title)):
        if value is not None:
            command += [flag, repr(value) if " " in value else value]
    if args.timing_only:
        command.append("--timing-only")
    for path in args.measured:
        command += ["--measured", path]
    try:
        out = build_report(args.inputs, args.out, title=args.title, timing_only=args.timing_only,
                           measured=args.measured, calibration_dir=args.calibration,
                           command=" ".join(command))
    except (ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"hkvsim: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    print(f"wrote {out / 'report.md'} (figures, report.json and trace.json beside it)")
    return EXIT_OK


# ---- calibrate ---------------------------------------------------------------------------------
def cmd_calibrate(args: argparse.Namespace) -> int:
    from .backends.calibrate import run_calibration_cli

    return run_calibration_cli(args)


# ---- listings ----------------------------------------------------------------------------------
def cmd_presets(args: argparse.Namespace) -> int:
    from .geometry.layout import unify_pages
    from .geometry.presets import preset, preset_names

    data = []
    for name in preset_names():
        m = preset(name)
        entry = {"preset": name, "architecture": m.architecture, "layers": m.num_layers,
                 "attention_layers": len(m.attention_layers), "state_layers": len(m.state_layers),
                 "kv_bytes_per_token": m.kv_bytes_per_token(1),
                 "state_bytes_per_request": m.state_bytes_per_request(1), "ppl_by_tp": {}}
        for tp in (1, 2, 4, 8):
            kernel, logical = unify_pages(m, tp, m.attention.attention_backend.min_kernel_block)
            entry["ppl_by_tp"][tp] = logical // kernel
        data.append(entry)
    if args.json:
        _emit_json(data)
        return EXIT_OK
    from rich.table import Table

    table = Table("preset", "architecture", "layers (attn/state)", "KV B/token (TP1)",
                  "state B/request (TP1)", "ppl TP1/2/4/8")
    for e in data:
        table.add_row(e["preset"], e["architecture"],
                      f"{e['layers']} ({e['attention_layers']}/{e['state_layers']})",
                      f"{e['kv_bytes_per_token']:,}", f"{e['state_bytes_per_request']:,}",
                      "/".join(str(v) for v in e["ppl_by_tp"].values()))
    _console().print(table)
    return EXIT_OK


def cmd_quirks(args: argparse.Namespace) -> int:
    from .connector.quirks import QUIRKS

    if args.json:
        _emit_json([{"name": q.name, "reproduces": q.reproduces, "symptom": q.symptom}
                    for q in QUIRKS.values()])
        return EXIT_OK
    for q in QUIRKS.values():
        print(f"{q.name}\n  reproduces: {q.reproduces}\n  symptom:    {q.symptom}")
    return EXIT_OK


def _version() -> str:
    """The installed distribution's version (package metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hkvsim")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "(unknown: not installed)"


def _common_flags(parser: argparse.ArgumentParser, *, default: Any) -> None:
    parser.add_argument("-v", "--verbose", action="store_true", default=default,
                        help="log connector events")
    parser.add_argument("--debug", action="store_true", default=default,
                        help="show tracebacks for errors")


def _subparser_with(common: argparse.ArgumentParser) -> type[argparse.ArgumentParser]:
    """A parser class whose instances (the subcommands) also take the common flags."""

    class SubcommandParser(argparse.ArgumentParser):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["parents"] = [*kwargs.get("parents", []), common]
            super().__init__(*args, **kwargs)

    return SubcommandParser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hkvsim",
        description="Testbed for KV-cache and SSM-state transfer between prefill and decode "
                    "engines (NIXL-connector semantics; dense, MLA and hybrid MLA+SSM models).",
        epilog="Exit status: 0 = every scenario met its [expect], 1 = one did not, "
               "2 = bad input.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _common_flags(parser, default=False)
    # the same flags after the command (`hkvsim run FILE --debug`); SUPPRESS keeps a flag given
    # before the command from being reset by the subcommand's default
    common = argparse.ArgumentParser(add_help=False)
    _common_flags(common, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_subparser_with(common))

    p = sub.add_parser("plan", help="resolve geometry, check the handshake and plan every "
                                    "request's descriptors without moving data")
    p.add_argument("file", help="scenario TOML file (a [sweep] plans every variant)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)

    for name, func, text in (
        ("run", cmd_run, "run a scenario on a backend and verify every byte"),
        ("sweep", cmd_sweep, "run every variant of a scenario's [sweep] and tabulate them"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("file", help="scenario TOML file")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.add_argument("--backend", default="sim", choices=["sim", "nixl"],
                       help="transport backend (default: sim, the simulated fabric; nixl: real "
                            "NIXL agents, one process per rank, DRAM over UCX)")
        p.add_argument("--timing-only", action="store_true",
                       help="move no bytes and skip verification (as [workload] verify = false)")
        if name == "run":
            p.add_argument("--requests", action="store_true",
                           help="include per-request details in --json output")
        p.set_defaults(func=func, requests=False)

    p = sub.add_parser("report", help="run scenarios (or read saved run results) and write a "
                                      "markdown + PNG report and a Perfetto trace")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="scenario TOML file, directory of them (each file one family), or a "
                        "saved `hkvsim run --json --requests` result")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: reports/<name of the first input>)")
    p.add_argument("--title", default=None, help="page title")
    p.add_argument("--timing-only", action="store_true",
                   help="move no bytes and skip verification (large sweeps)")
    p.add_argument("--measured", action="append", default=[], metavar="RESULT.json",
                   help="saved `hkvsim run --json --requests` output of the same scenarios on a "
                        "real backend: fills the measured columns (repeatable)")
    p.add_argument("--calibration", default="reports/calibration", metavar="DIR",
                   help="calibration data for the simulated-vs-measured plot (default: "
                        "reports/calibration)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("calibrate", help="measure real NIXL transfers on this machine, fit the "
                                         "fabric profile and report simulated vs measured")
    p.add_argument("--profile-out", default=None, metavar="FILE",
                   help="profile to write (default: the shipped "
                        "hkvsim/fabric/profiles/cpu-ucx-loopback.toml)")
    p.add_argument("--report-dir", default="reports/calibration", metavar="DIR",
                   help="where the sweep table and points go (default: reports/calibration)")
    p.add_argument("--budget", type=float, default=150.0, metavar="SECONDS",
                   help="wall-clock budget of the sweep (default: 150)")
    p.add_argument("--quick", action="store_true",
                   help="a small sweep (seconds), for smoke tests; writes nothing by default")
    p.add_argument("--json", action="store_true", help="print the fit as JSON")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("presets", help="list the model presets and their key numbers")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_presets)
    p = sub.add_parser("quirks", help="list the named replays of known connector bugs")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_quirks)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args))
    except _input_errors() as exc:
        if args.debug:
            raise
        print(f"hkvsim: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
