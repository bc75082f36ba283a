"""``hkvsim``: plan, run and sweep P/D KV-transfer scenarios.

Exit status: 0 when every scenario's [expect] is met, 1 when one is not, 2 on bad input (one
clear error line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]

EXIT_OK, EXIT_EXPECTATION, EXIT_INPUT = 0, 1, 2
_EXIT_HELP = ("Exit status: 0 = every scenario met its [expect], 1 = one did not, 2 = bad "
              "input, or a run that could not start (a rank could not register its cache).")


def _input_errors() -> tuple[type[BaseException], ...]:
    from .connector.tp import TPError
    from .fabric import PlacementError, ProfileError
    from .fabric.links import FabricError
    from .geometry.specs import GeometryError
    from .memory_estimate import MemoryGuardError
    from .pd.records import RankSetupError
    from .scenario import ScenarioError
    from .shards import SelectionError

    return (ScenarioError, GeometryError, ProfileError, PlacementError, FabricError, TPError,
            SelectionError, RankSetupError, MemoryGuardError)


def _load(path: str) -> list[Any]:
    from .scenario import load_scenarios

    return load_scenarios(path)


def _emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def _fail_input(message: str) -> int:
    print(f"hkvsim: error: {message}", file=sys.stderr)
    return EXIT_INPUT


def _console() -> Any:
    from rich.console import Console

    # a pipe or a CI log gets a wide, stable layout instead of rich's 80-column default
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _progress(items: Sequence[Any], label: str) -> Any:
    """Iterate with a progress bar on a terminal (stderr), silently otherwise."""
    from .progress import iterate

    return iterate(items, label)


def _bar(total: int, label: str) -> Any:
    from .progress import bar

    return bar(total, label)


# ---- plan --------------------------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import plan_scenario

    from .memory_estimate import estimate_memory
    from .pd.deployment import build_deployment

    plans = [plan_scenario(s) for s in _progress(_load(args.file), "planning")]
    if not args.json:  # (plan --json stays the planned transfers only)
        for s, plan in zip(_load(args.file), plans):
            plan["memory"] = estimate_memory(build_deployment(s)).as_dict()
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
    mem = plan.get("memory")
    if mem:
        from .memory_estimate import describe

        console.print(f"peak memory (estimate): verified run {describe(mem['verified_bytes'])} "
                      f"({describe(mem['cache_pages_bytes'])} of cache pages touched, "
                      f"{describe(mem['descriptor_list_bytes'])} of descriptor lists); "
                      f"timing-only {describe(mem['timing_only_bytes'])}")
    reqs = plan["requests"]
    if reqs:
        t = Table("request", "prompt", "hit asked", "hit reused", "descriptors",
                  "after NIXL coalescing", "bytes", "transfers", "predicted transfer",
                  title="planned requests")
        for r in reqs[:20]:
            pred = r.get("predicted_transfer_seconds")
            reused = r["effective_prefix_hit_tokens"]
            t.add_row(str(r["index"]), f"{r['prompt_tokens']:,}", f"{r['prefix_hit_tokens']:,}",
                      "-" if reused is None else f"{reused:,}",
                      f"{r['descriptors']:,}",
                      "-" if r["descriptors_coalesced"] is None
                      else f"{r['descriptors_coalesced']:,}", f"{r['bytes']:,}",
                      str(r["transfers"]),
                      f"{pred * 1e3:.3f} ms" if pred is not None else r.get("error", "-"))
        if len(reqs) > 20:
            t.caption = f"first 20 of {len(reqs)} requests"
        console.print(t)


# ---- run / sweep -------------------------------------------------------------------------------
def _selected(args: argparse.Namespace, count: int) -> list[int]:
    """The variant indices this invocation runs (--shard, and --variants for --jobs children)."""
    from .shards import Shard, parse_variant_list

    indices = Shard.parse(args.shard).select(count) if args.shard else list(range(count))
    if args.variants:
        wanted = set(parse_variant_list(args.variants, count))
        indices = [i for i in indices if i in wanted]
    return indices


def _run_all(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[Any]]:
    """Run the selected variants; their result JSON in variant order, and the file's
    scenarios."""
    from .results import result_json
    from .shards import SelectionError, run_children

    scenarios = _load(args.file)
    indices = _selected(args, len(scenarios))
    count = len(scenarios)
    if not args.force:  # each variant must fit in the memory available now
        from .memory_estimate import check_fits

        for i in indices:
            check_fits(scenarios[i], timing_only=args.timing_only)
    if args.jobs < 1:
        raise SelectionError(f"--jobs {args.jobs}: expected a number of processes >= 1")
    if args.progress_thread and args.backend != "nixl":
        raise SelectionError("--progress-thread is NIXL's: use it with --backend nixl (the "
                             "simulated fabric's profile says how its ranks poll)")
    if args.jobs > 1 and len(indices) > 1:
        if args.backend != "sim":
            raise SelectionError(f"--jobs {args.jobs} with --backend {args.backend}: every "
                                 f"variant already runs one process per rank; spread a sweep "
                                 f"over machines with --shard i/n instead")
        flags = [f for f, on in (("--timing-only", args.timing_only),
                                 ("--requests", args.requests), ("--force", args.force)) if on]
        chunks = min(len(indices), args.jobs)
        with _bar(chunks, f"running {len(indices)} variants in {chunks} processes") as step:
            return run_children(args.file, indices, jobs=args.jobs, flags=flags,
                                on_chunk=step), scenarios
    if args.backend == "nixl":  # real NIXL, one process per rank (hkvsim/backends)
        from .drivers.nixl import run_for_cli

        results = run_for_cli([scenarios[i] for i in indices], timing_only=args.timing_only,
                              progress=_progress, progress_thread=args.progress_thread)
        return [result_json(r, requests=args.requests, position=(i, count))
                for i, r in zip(indices, results)], scenarios
    from .cluster import run_scenario

    if len(indices) == 1:  # one variant: progress by request (a long run is not silent)
        (i,) = indices
        with _bar(scenarios[i].workload.num_requests, "requests served") as step:
            result = run_scenario(scenarios[i], timing_only=args.timing_only,
                                  progress=lambda _record: step())
        return [result_json(result, requests=args.requests, position=(i, count))], scenarios
    return [result_json(run_scenario(scenarios[i], timing_only=args.timing_only),
                        requests=args.requests, position=(i, count))
            for i in _progress(indices, "running")], scenarios


def _envelope(args: argparse.Namespace, data: list[dict[str, Any]], count: int
              ) -> dict[str, Any]:
    """The JSON of several variants (every sweep file, and any --shard / --jobs run)."""
    from .shards import Shard

    shard = str(Shard.parse(args.shard)) if args.shard else None
    return {"source": args.file, "variants": count, "shard": shard,
            "expectation_met": all(d["expectation_met"] for d in data),
            "verified": bool(data) and all(d["verified"] for d in data), "scenarios": data}


def cmd_run(args: argparse.Namespace) -> int:
    data, scenarios = _run_all(args)
    met = all(d["expectation_met"] for d in data)
    if args.json:
        # one object for a file without [sweep]; the envelope for a sweep (whatever the
        # number of variants) and for any --shard / --jobs run
        flat = not scenarios[0].sweep_point and not args.shard and args.jobs == 1
        _emit_json(data[0] if flat and len(data) == 1 else _envelope(args, data, len(scenarios)))
    else:
        console = _console()
        for d in data:
            _print_result(console, d)
    return EXIT_OK if met else EXIT_EXPECTATION


def _bytes_line(req: dict[str, Any], verification: str) -> str:
    """What the oracle says, never more: 'not verified' when it did not run."""
    if verification == "timing-only":
        return "bytes [yellow]not verified[/] (timing-only)"
    if verification == "nothing-checked":
        return "bytes [yellow]not verified[/]: no request completed, nothing reached the oracle"
    text = f"bytes verified: {req['byte_exact']} request(s) byte-exact"
    if req["corrupted"]:
        text += f", [red]{req['corrupted']} corrupted[/] (reported successful with wrong bytes)"
    if req["mismatched_bytes"]:
        text += f", [red]{req['mismatched_bytes']:,} mismatched bytes[/]"
    return text


def _print_result(console: Any, d: dict[str, Any]) -> None:
    from rich.markup import escape

    req = d["requests"]
    status = "[green]expectation met[/]" if d["expectation_met"] else "[red]EXPECTATION NOT MET[/]"
    console.rule(f"[bold]{escape(d['scenario'])}[/]")
    console.print(f"outcome [bold]{d['outcome']}[/] - {status}")
    counts = f"requests: {req['completed']}/{req['total']} completed, {req['failed']} failed, "
    counts += f"{req['hung']} hung" + (f", {req['aborted']} aborted" if req["aborted"] else "")
    console.print(f"{counts}; {_bytes_line(req, d['verification'])}")
    # only what leaked, in red; "none" when every counter is zero
    leaks = ", ".join(f"{k} {v}" for k, v in d["leaks"].items() if v)
    console.print(f"moved {req['bytes']:,} B in {req['descriptors']:,} descriptors over "
                  f"{req['transfers']:,} transfers; leaks: "
                  + (f"[red]{leaks}[/]" if leaks else "none"))
    t = d["time"]
    clock = "simulated" if t["clock"] == "simulated" else "wall clock"
    line = f"elapsed {t['elapsed_seconds']:.3f} s ({clock})"
    if t["transfer_seconds"]:
        ts = t["transfer_seconds"]
        line = f"transfer time p50 {ts['p50'] * 1e3:.3f} ms, p99 {ts['p99'] * 1e3:.3f} ms; " + line
    console.print(line)
    counters = [f"{k} {v:,}" for k, v in d["counters"].items() if v]
    if counters:
        console.print("counters: " + ", ".join(counters))
    for text in d["handshake_errors"][:3]:
        console.print(f"[red]handshake:[/] {escape(text)}", soft_wrap=True)
    for f in d["failures"][:3]:
        console.print(f"[red]request {f['request']} failed[/] ({f['class']}): "
                      f"{escape(str(f['reason']))}", soft_wrap=True)
    for m in d["mismatches"][:5]:
        console.print(f"[red]mismatch:[/] {escape(m)}", soft_wrap=True)
    for p in d["expectation_problems"]:
        console.print(f"[red]expectation:[/] {escape(p)}", soft_wrap=True)


# dotted sweep keys -> what the 80-column sweep table shows (the table's caption spells them out)
_SECTION_ABBREV = {"prefill": "P", "decode": "D"}
_LEAF_ABBREV = {"descriptor_merge": "merge", "attention_backend": "attn",
                "registration_order": "order", "prefix_caching": "prefix",
                "kv_cache_layout": "layout", "block_size": "block", "num_blocks": "blocks",
                "prompt_tokens": "prompt", "prefix_hit_tokens": "hit",
                "max_inflight": "inflight", "cache_dtype": "dtype", "preset": "model",
                "kv_load_failure_policy": "on-failure", "tokens_per_second": "tok/s",
                "enforce_handshake_compat": "compat"}


def _variant_keys(keys: Sequence[str]) -> dict[str, str]:
    """Short, unambiguous names for swept keys: ``prefill.tp`` -> ``P.tp``, ``connector.mode`` ->
    ``mode``, ``connector.descriptor_merge`` -> ``merge`` (the full key when two would clash)."""
    short = {}
    for key in keys:
        section, _, leaf = key.partition(".")
        name = _LEAF_ABBREV.get(leaf, leaf)
        short[key] = f"{_SECTION_ABBREV[section]}.{name}" if section in _SECTION_ABBREV else name
    clashes = {v for v in short.values() if list(short.values()).count(v) > 1}
    return {k: (k if v in clashes else v) for k, v in short.items()}


def _format_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "/".join(str(v) for v in value)
    return str(value)


def _sweep_table(data: list[dict[str, Any]], scenarios: list[Any], *, shard: str | None
                 ) -> Any:
    """The sweep's rich table: one row per variant, labelled with short key names (spelled out
    in the caption) so that it stays readable at 80 columns."""
    from rich.markup import escape
    from rich.table import Table

    from .results import summary_row

    short = _variant_keys(list(scenarios[0].sweep_point))
    title = scenarios[0].scenario.name.split(" [")[0]
    shown = f"{len(data)} of {len(scenarios)} variant(s), shard {shard}" if shard \
        else f"{len(data)} variant(s)"
    table = Table(title=escape(f"{title}: {shown}"))
    table.add_column("variant", overflow="fold", ratio=1)
    for head in ("outcome", "expect", "requests", "bytes", "descriptors", "transfer p50"):
        table.add_column(head, justify="left" if head in ("outcome", "expect", "bytes") else
                         "right", no_wrap=head != "outcome")
    for d in data:
        row = summary_row(d)
        point = d["sweep_point"]
        label = " ".join(f"{short[k]}={_format_value(v)}" for k, v in point.items()) \
            if point else row["scenario"]
        if row["verification"] == "timing-only":
            checked = "not verified"
        elif row["verification"] == "nothing-checked":
            checked = "nothing checked"
        elif row["corrupted"] or row["mismatched_bytes"]:
            checked = f"[red]{row['corrupted']} corrupted[/]"
        else:
            checked = "exact"
        p50 = row["transfer_p50_ms"]
        table.add_row(escape(label), row["outcome"],
                      "[green]met[/]" if row["met"] else "[red]NOT MET[/]", row["requests"],
                      checked, f"{row['descriptors']:,}>"
                      + ("?" if row["coalesced"] is None else f"{row['coalesced']:,}"),
                      "-" if p50 is None else f"{p50:.3f} ms")
    renamed = [f"{v} = {k}" for k, v in short.items() if v != k]
    table.caption = escape("; ".join(renamed + ["descriptors: planned>after NIXL coalescing"]))
    return table


def cmd_sweep(args: argparse.Namespace) -> int:
    data, scenarios = _run_all(args)
    met = all(d["expectation_met"] for d in data)
    if args.json:
        _emit_json(_envelope(args, data, len(scenarios)))
    else:
        _console().print(_sweep_table(data, scenarios, shard=_envelope(args, data, 0)["shard"]))
    return EXIT_OK if met else EXIT_EXPECTATION


# ---- report ------------------------------------------------------------------------------------
def cmd_report(args: argparse.Namespace) -> int:
    from .report import build_report

    command = ["hkvsim", "report", *args.inputs]
    for flag, value in (("--out", args.out), ("--title", args.title),
                        ("--compare", args.compare)):
        if value is not None:
            command += [flag, repr(value) if " " in value else value]
    for flag, on in (("--timing-only", args.timing_only), ("--csv", args.csv)):
        if on:
            command.append(flag)
    for path in args.measured:
        command += ["--measured", path]
    try:
        out, report = build_report(args.inputs, args.out, title=args.title,
                                   timing_only=args.timing_only, measured=args.measured,
                                   calibration_dir=args.calibration, command=" ".join(command),
                                   compare=args.compare, csv=args.csv)
    except (ValueError, OSError) as exc:
        if args.debug:
            raise
        return _fail_input(str(exc))
    print(f"wrote {out / 'report.md'} (figures, report.json and trace.json beside it"
          + (", requests.csv" if args.csv else "") + ")")
    variants = report["variants"]
    counts = report["verification"]
    print("verification: " + ", ".join(f"{n} {k}" for k, n in counts.items() if n))
    unmet = [v for v in variants if not v["expectation_met"]]
    if unmet:
        first = unmet[0]
        print(f"{len(unmet)} of {len(variants)} variant(s) did not meet their [expect]; first: "
              f"{first['name']}: {(first['expectation_problems'] or ['?'])[0]}")
        return EXIT_EXPECTATION
    return EXIT_OK


# ---- calibrate ---------------------------------------------------------------------------------
def cmd_calibrate(args: argparse.Namespace) -> int:
    from .backends.calibrate import run_calibration_cli

    return run_calibration_cli(args)


# ---- validate ----------------------------------------------------------------------------------
def cmd_validate(args: argparse.Namespace) -> int:
    import os
    import platform
    import time
    from pathlib import Path

    from .shards import SelectionError
    from .transport.nixl import NixlUnavailable, load_nixl
    from .validate import ValidationError, summary, validate, write_outputs

    files = [Path(f) for f in args.files] or sorted(Path("scenarios/validation").glob("*.toml"))
    try:
        load_nixl()
        results = validate(files, repeats=args.repeats, timing_only=args.timing_only,
                           warm_up=args.warm_up,
                           progress=lambda text: print(f"validate: {text}", file=sys.stderr))
    except (ValidationError, NixlUnavailable) as exc:
        raise SelectionError(str(exc)) from None
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "machine": f"{os.cpu_count()} CPU(s), {platform.platform()}, Python "
                       f"{platform.python_version()}", "repeats": args.repeats,
            "warm_up": args.warm_up,
            "source": os.path.commonpath([str(f.parent) for f in files]) + "/",
            "timing_only": bool(args.timing_only)}
    if args.out:
        for path in write_outputs(results, Path(args.out), meta):
            print(f"wrote {path}")
    s = summary(results)
    if args.json:
        _emit_json({"summary": s, "files": [
            {"file": r.file, "sim_seconds": r.sim_seconds, "real_seconds": list(r.real_seconds),
             "error": r.error, "spread": r.spread} for r in results]})
    else:
        for r in results:
            print(f"{Path(r.file).name}: sim {r.sim_seconds * 1e3:.3f} ms, real "
                  f"{r.real_median * 1e3:.3f} ms (spread {100 * r.spread:.0f} %), error "
                  f"{100 * r.error:+.0f} %")
        print(f"median |error| {100 * s['median_abs_error']:.0f} %, worst "
              f"{100 * s['worst_abs_error']:.0f} %: acceptance "
              f"{'met' if s['accepted'] else 'NOT met'}")
    return EXIT_OK if s["accepted"] else EXIT_EXPECTATION


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


def cmd_diff(args: argparse.Namespace) -> int:
    """Run each variant with hkvsim's connector core and with vLLM's; list where they differ,
    naming the documented vLLM finding that explains a variant's differences (as hkvsim fuzz
    does). Exit 0 when they agree everywhere (with --allow-known: when a documented finding
    explains every variant's differences), 1 otherwise."""
    from .fuzz import diff_finding
    from .fuzz_known import explain, facts
    from .implementations.diff import core_extent, diff_scenario

    scenarios = _load(args.file)
    diffs, variants = [], []
    for s in scenarios:
        found, core, vllm = diff_scenario(s, backend=args.backend)
        diffs += found
        version = vllm.implementation.get("version")
        known = None
        if found:
            where = f"{s.model_spec().name} {s.connector.mode}"
            known = explain(diff_finding(found, core, vllm, where), facts(s), version)
        variants.append({"variant": s.scenario.name, "differences": len(found),
                         "hkvsim_outcome": core.outcome, "vllm_outcome": vllm.outcome,
                         "hkvsim_transfer_extent": core_extent(s, version),
                         "vllm_version": version, "known": known})
    unexplained = sum(v["differences"] > 0 and v["known"] is None for v in variants)
    if args.json:
        _emit_json({"source": args.file, "backend": args.backend, "variants": variants,
                    "differences": [d.as_dict() for d in diffs]})
    else:
        for v in variants:
            label = ("" if not v["differences"] else f" [{v['known']}]" if v["known"]
                     else " [NEW: no documented vLLM finding explains them]")
            extent = ("" if v["hkvsim_transfer_extent"] == "allocated"
                      else f" (transfer extent {v['hkvsim_transfer_extent']})")
            print(f"{v['variant']}: hkvsim{extent} {v['hkvsim_outcome']}, vLLM "
                  f"{v['vllm_version']} {v['vllm_outcome']}, {v['differences']} "
                  f"difference(s){label}")
        for d in diffs:
            print(f"  {d}")
        where = "" if args.backend == "sim" else f" (backend {args.backend})"
        print(f"{len(diffs)} difference(s) in {len(variants)} variant(s){where}"
              + (f"; {unexplained} variant(s) with differences no documented vLLM finding "
                 f"explains" if diffs else ""))
    if not diffs or (args.allow_known and not unexplained):
        return EXIT_OK
    return EXIT_EXPECTATION


# hkvsim.fuzz.FUZZ_PRESETS, spelled here so that building the parser imports nothing heavy
FUZZ_PRESETS_DEFAULT = ("tiny-kimi-linear", "tiny-qwen3-next", "tiny-deepseek", "tiny-llama")


def cmd_fuzz(args: argparse.Namespace) -> int:
    """Random valid deployments, each run and checked against the rules no run may break.
    Exit 0 when nothing broke one (with --allow-known: when a documented vLLM finding explains
    each that did), 1 when something did, 2 for bad options."""
    from pathlib import Path

    from .connector.quirks import quirk_names
    from .fuzz import FuzzOptions, fuzz
    from .geometry.presets import preset_names

    presets = tuple(p.strip() for p in args.presets.split(",") if p.strip())
    unknown = [p for p in presets if p not in preset_names()]
    if unknown:
        return _fail_input(f"--presets: unknown preset(s) {', '.join(unknown)}; allowed: "
                           f"{', '.join(preset_names())}")
    if args.quirk is not None and args.quirk not in quirk_names():
        return _fail_input(f"--quirk: unknown quirk {args.quirk!r}; allowed: "
                           f"{', '.join(quirk_names())} (hkvsim quirks describes them)")
    try:
        options = FuzzOptions(seed=args.seed, count=args.count, presets=presets,
                              max_requests=args.max_requests,
                              max_prompt_tokens=args.max_prompt_tokens, faults=args.faults,
                              quirk=args.quirk, implementation=args.implementation,
                              determinism=args.determinism, backend=args.backend,
                              max_ranks=args.max_ranks,
                              scenario_timeout=args.scenario_timeout, time_limit=args.time_limit)
    except ValueError as exc:
        return _fail_input(f"fuzz: {exc}")
    out = Path(args.out) if args.out else None
    if not args.verbose:  # the runs' own warnings (prefix hits rounded down, vLLM's notes on
        # its CPU platform) would drown the findings; vLLM reads its level when first imported
        for name in ("hkvsim", "vllm"):
            logging.getLogger(name).setLevel(logging.ERROR)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

    def said(case: Any) -> None:
        if not args.json:
            for f in case.findings:
                known = f" [known: {f.known}]" if f.known else ""
                print(f"scenario {case.index}: {f.implementation}: {f.kind}{known}: "
                      f"{f.detail}"[:300], flush=True)

    from .transport.nixl import NixlUnavailable

    try:
        report = fuzz(options, out_dir=out, on_case=said)
    except NixlUnavailable as exc:  # --backend nixl where NIXL cannot be imported
        print(f"hkvsim: error: fuzz --backend nixl: {exc}", file=sys.stderr)
        return EXIT_INPUT
    data = report.as_dict()
    if args.json:
        _emit_json({k: v for k, v in data.items() if k != "cases"} | (
            {"cases": data["cases"]} if args.out is None else {}))
    else:
        where = f" (vLLM {data['vllm_version']})" if data["vllm_version"] else ""
        print(f"{data['ran']} scenario(s) of seed {data['seed']} in {data['seconds']:.1f} s"
              f"{' (time limit reached)' if data['stopped_early'] else ''}: "
              f"{data['checked']} checked, {data['skipped']} skipped, "
              f"{data['refused_input']} refused by the input checks; implementation "
              f"{data['implementation']}{where}"
              + (" on real NIXL" if data["backend"] == "nixl" else ""))
        for name, counts in data["outcomes"].items():
            print(f"  {name} outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
        for reason, n in sorted(data["skip_reasons"].items(), key=lambda kv: -kv[1]):
            print(f"  skipped {n}: {reason}")
        print(f"{data['findings']} finding(s) in {data['scenarios_with_findings']} scenario(s), "
              f"{len(data['groups'])} signature(s)"
              + (f"; {data['new_findings']} new (in {data['scenarios_with_new_findings']} "
                 f"scenario(s)), {data['findings'] - data['new_findings']} explained by "
                 "documented vLLM findings" if data["implementation"] != "hkvsim" else ""))
        for g in data["groups"]:
            known = [k or "NEW" for k in g["known"]] if data["implementation"] != "hkvsim" else []
            print(f"  {g['scenarios']:>4} x {g['signature']} (e.g. scenario {g['example']})"
                  + (f" [{', '.join(known)}]" if known else ""))
        if out is not None:
            print(f"wrote {out / 'fuzz.json'}"
                  + (f" and {data['scenarios_with_findings']} finding-NNNN.toml file(s)"
                     if data["scenarios_with_findings"] else ""))
    failing = data["new_findings"] if args.allow_known else data["findings"]
    return EXIT_OK if not failing else EXIT_EXPECTATION


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
        epilog=_EXIT_HELP)
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
        ("run", cmd_run, "run a scenario (every variant of a [sweep]) and verify every byte"),
        ("sweep", cmd_sweep, "run every variant of a scenario's [sweep] and tabulate them"),
    ):
        p = sub.add_parser(name, help=text, description=text + ". " + _EXIT_HELP)
        p.add_argument("file", help="scenario TOML file")
        p.add_argument("--json", action="store_true",
                       help="machine-readable output: run prints one object for a file "
                            "without [sweep]; otherwise (and for sweep) {source, variants, "
                            "shard, expectation_met, verified, scenarios: [...]}")
        p.add_argument("--requests", action="store_true",
                       help="include per-request details in --json output (what `hkvsim "
                            "report` reads back)")
        p.add_argument("--backend", default="sim", choices=["sim", "nixl"],
                       help="transport backend (default: sim, the simulated fabric; nixl: real "
                            "NIXL agents, one process per rank, DRAM over UCX)")
        p.add_argument("--timing-only", action="store_true",
                       help="move no bytes and skip verification (as [workload] verify = false; "
                            "an [expect] byte_exact = true is then not met)")
        p.add_argument("--progress-thread", action="store_true",
                       help="with --backend nixl: NIXL's progress thread on in every rank, as "
                            "vLLM's connector runs it (default off: ranks poll NIXL in their "
                            "loop, and a transfer that carries a notification then completes "
                            "only at its remote rank's next NIXL call)")
        p.add_argument("--jobs", type=int, default=1, metavar="N",
                       help="split the variants over N child hkvsim processes on this "
                            "machine (simulator only; the same results as a serial run)")
        p.add_argument("--shard", default=None, metavar="I/N",
                       help="run only the variants whose index is I modulo N (0 <= I < N), to "
                            "spread a sweep over N machines; `hkvsim report` merges the saved "
                            "--json --requests outputs")
        p.add_argument("--force", action="store_true",
                       help="run a verified scenario even when its memory estimate (see "
                            "`hkvsim plan`) exceeds the memory available")
        p.add_argument("--variants", default=None, help=argparse.SUPPRESS)  # --jobs children
        p.set_defaults(func=func)

    p = sub.add_parser("report", help="run scenarios (or read saved run results) and write a "
                                      "markdown + PNG report and a Perfetto trace",
                       description="Run scenarios (or read saved `run|sweep --json --requests` "
                                   "results, e.g. the shards of a sweep) and write a markdown + "
                                   "PNG report, report.json and a Perfetto trace. "
                                   + _EXIT_HELP)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="scenario TOML file, directory of them (each file one family), or a "
                        "saved `hkvsim run|sweep --json --requests` result (shards of one sweep "
                        "are merged)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: reports/<name of the first input>)")
    p.add_argument("--title", default=None, help="page title")
    p.add_argument("--compare", default=None, metavar="AXIS",
                   help="put the values of AXIS side by side: input, backend, or a scenario key "
                        "such as connector.mode or connector.descriptor_merge (default: input "
                        "when several inputs are given)")
    p.add_argument("--csv", action="store_true",
                   help="also write requests.csv, one row per request of every variant")
    p.add_argument("--timing-only", action="store_true",
                   help="move no bytes and skip verification (large sweeps; an [expect] "
                        "byte_exact = true is then not met)")
    p.add_argument("--measured", action="append", default=[], metavar="RESULT.json",
                   help="saved `hkvsim run --json --requests` output of the same scenarios on a "
                        "real backend: fills the measured columns (repeatable)")
    p.add_argument("--calibration", default="reports/calibration", metavar="DIR",
                   help="measurements for the simulated-vs-measured plot, shown only for the "
                        "fabric profiles the report uses (default: reports/calibration)")
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
    p.add_argument("--host", action="store_true",
                   help="instead of the sweep: fit the host-path constants (the node's CPU "
                        "cores shared by every rank's dispatch, post, copy, completion and "
                        "oracle work and the coordinator's; fitted: per-core copy rate, "
                        "completion notice and core contention; measured in the real runs' "
                        "processes: rank dispatch per post and per operation, coordinator "
                        "CPU per call, oracle CPU per operation and per byte, a rank loop's "
                        "CPU per NIXL poll; "
                        "the rank loop's poll periods) on the FIT scenario files, "
                        "judge them on the held-out files, and write the profile only if the "
                        "held-out median |error| <= 15 %% and the worst <= 40 %%")
    p.add_argument("--fit", nargs="+", default=None, metavar="FILE",
                   help="--host: FIT scenario files (default: scenarios/fit/*.toml)")
    p.add_argument("--held-out", nargs="+", default=None, metavar="FILE",
                   help="--host: held-out scenario files (default: scenarios/validation/*.toml)")
    p.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="--host: real runs per file, in one series over both sets, FIT and "
                        "held-out files interleaved in every pass (default: 3)")
    p.add_argument("--warm-up", type=int, default=1, metavar="N",
                   help="--host: passes over every FIT and every held-out file on real NIXL "
                        "before the measured ones, left out of the fit and of the judgement "
                        "(default: 1; the first runs after an idle spell are slow)")
    p.add_argument("--force", action="store_true",
                   help="fit even when the 1-minute load average exceeds the core count "
                        "(refused otherwise; the load is recorded either way)")
    p.add_argument("--replay", default=None, metavar="JSON",
                   help="--host: instead of real runs, refit the per-core rate, notice and "
                        "core contention on the FIT real runs stored in a calibration's JSON "
                        "(host-path.json or host-path-refused.json) with the code as it is "
                        "now, and judge the held-out files on their stored runs; needs no "
                        "NIXL, writes nothing "
                        "(exit 0 within the bounds, 1 outside)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("validate", help="run held-out scenario files on the simulator and on "
                                        "real NIXL and report simulated vs real per file")
    p.add_argument("files", nargs="*", metavar="FILE",
                   help="scenario files without [sweep] (default: scenarios/validation/*.toml)")
    p.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="real runs per file, interleaved across files (default: 3)")
    p.add_argument("--warm-up", type=int, default=1, metavar="N",
                   help="passes over every file on real NIXL before the measured ones, left "
                        "out of every figure (default: 1; the first runs after an idle spell "
                        "are slow)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write held-out-cpu.md and held-out-cpu.json there "
                        "(-timing-only.md/.json with --timing-only; e.g. reports/fidelity)")
    p.add_argument("--timing-only", action="store_true",
                   help="run both backends without the oracle (bytes move, none is filled or "
                        "checked): the real ranks then spend no CPU on the oracle while copies "
                        "run; nothing is verified")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("presets", help="list the model presets and their key numbers")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_presets)
    p = sub.add_parser("diff", help="run a scenario with hkvsim's connector core and with "
                                    "vLLM's (needs scripts/with-vllm); list where they differ. "
                                    "The core moves what the installed release moves (its "
                                    "transfer_extent: 'needed' beside 0.34.0) unless the file "
                                    "sets connector.transfer_extent")
    p.add_argument("file", help="scenario file (.toml)")
    p.add_argument("--backend", default="sim", choices=["sim", "nixl"],
                   help="where both implementations run (default: sim, the simulated fabric; "
                        "nixl: real NIXL agents, one process per rank, DRAM)")
    p.add_argument("--allow-known", action="store_true",
                   help="exit 0 when a documented vLLM finding explains every variant's "
                        "differences (each variant still lists them, with its name)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_diff)
    p = sub.add_parser("fuzz", help="run random valid deployments (both modes, every TP pair, "
                                    "block size ratios, prefix hits, merging, faults) and "
                                    "report every run that corrupts, hangs, leaks or fails")
    p.add_argument("--count", type=int, default=50, help="scenarios to draw (default 50)")
    p.add_argument("--seed", type=int, default=0,
                   help="the seed: scenario i of a seed is the same file on any machine")
    p.add_argument("--presets", default=",".join(FUZZ_PRESETS_DEFAULT),
                   help="comma-separated model presets to draw from (default: the four tiny "
                        "ones)")
    p.add_argument("--faults", action="store_true",
                   help="add one or two faults per scenario (short leases and watchdogs); "
                        "failures are then allowed, corruption, hangs and leaks still are not")
    p.add_argument("--quirk", default=None, metavar="NAME",
                   help="replay a known connector bug in hkvsim's core on every scenario "
                        "(hkvsim quirks lists them): the findings are the deployments it breaks")
    p.add_argument("--implementation", default="hkvsim", choices=["hkvsim", "vllm", "both"],
                   help="whose connector runs: hkvsim's core (default), vLLM's (under "
                        "scripts/with-vllm VERSION), or both, adding every difference hkvsim "
                        "diff reports")
    p.add_argument("--determinism", action="store_true",
                   help="run every scenario twice and report any that differs")
    p.add_argument("--max-requests", type=int, default=6,
                   help="requests per scenario, at most (default 6)")
    p.add_argument("--max-prompt-tokens", type=int, default=3000,
                   help="prompt tokens per request, at most (default 3000)")
    p.add_argument("--scenario-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="wall time one run may take before it counts as a finding (default "
                        "120)")
    p.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="start no new scenario after this much wall time")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write fuzz.json and each finding's scenario (finding-NNNN.toml, with "
                        "the command that reproduces it) there")
    p.add_argument("--backend", choices=["sim", "nixl"], default="sim",
                   help="where each scenario runs (default: sim, the simulated fabric; nixl: "
                        "real NIXL agents, one process per rank, DRAM over UCX; without "
                        "--faults and --determinism)")
    p.add_argument("--max-ranks", type=int, default=8, metavar="N",
                   help="with --backend nixl: skip a drawn deployment of more than N rank "
                        "processes (default 8; each rank is a process, vLLM's import its own)")
    p.add_argument("--allow-known", action="store_true",
                   help="exit 0 when a documented vLLM finding explains every finding "
                        "(docs/vllm.md; each is still listed, with its name); hkvsim's own "
                        "findings are never explained")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_fuzz)
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
        return _fail_input(str(exc))
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
