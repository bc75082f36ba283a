"""``hkvsim fuzz``: random valid deployments, run and checked against the rules no run may break.

Each scenario is drawn from a seed (``--seed`` and its index: the same seed gives the same
scenario files on any machine) over the knobs where connector bugs have lived: the four small
presets (dense GQA, MLA, hybrid MLA + KDA, hybrid GQA + GDN), prefill and decode TP in
{1, 2, 4, 8}, pull and push, block size ratios where the handshake rules allow them, several
engine instances, warmed-up (fragmented) block ids, prefix caching with hits on and off a block
boundary, the three descriptor-merge modes, the three registration orders, bursts and Poisson
arrivals with a cap on requests in flight, prompts on either side of a block boundary, and (with
``--faults``) up to two transport or request faults with short leases and watchdogs.

Every run is checked against what must hold whatever the deployment:

- ``corruption``: no request reported successful holds a wrong byte, and no transfer lands in
  blocks its request does not own;
- ``hang``: every request ends (ok, failed or aborted);
- ``leak``: nothing is left allocated or registered;
- ``not-ok``: without faults, every request succeeds (the generator only draws deployments the
  handshake rules accept, so a refusal or a failed request is a finding too);
- ``crash``: the run raises no exception (a scenario error is the generator's, and reported as
  such, not as a finding);
- ``timeout``: the run ends within ``--scenario-timeout`` seconds of wall time;
- ``nondeterministic`` (``--determinism``): a second run of the same file gives the same
  statuses, descriptors, bytes and simulated times.

``--implementation vllm`` runs a vLLM release's own connector instead of hkvsim's core (under
``scripts/with-vllm VERSION``); ``--implementation both`` runs each scenario with both and adds
every difference ``hkvsim diff`` reports (``diff``). A deployment vLLM's harness cannot run is
counted as skipped with its reason. ``--quirk NAME`` replays a known connector bug in hkvsim's
core on every scenario: the runs where it breaks a rule are the deployments that expose it.

``--backend nixl`` runs each scenario over real NIXL agents instead of the simulated fabric (one
process per rank, DRAM over UCX on loopback: the bytes the checks read moved for real), without
faults or ``--determinism``; ``--scenario-timeout`` then bounds each workload through the real
driver's own deadline.

Findings are grouped by signature (what broke, the model and the mode); with ``--out DIR`` each
finding's scenario is written as ``finding-NNNN.toml`` with the command that reproduces it, and
``fuzz.json`` holds every scenario's result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import signal
import threading
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .scenario import REQUEST_ONLY_FAULTS, ScenarioError, parse_scenarios

__all__ = ["FuzzOptions", "Finding", "FuzzCase", "generate", "check_run", "fuzz",
           "FUZZ_PRESETS", "IMPLEMENTATIONS"]

FUZZ_PRESETS = ("tiny-kimi-linear", "tiny-qwen3-next", "tiny-deepseek", "tiny-llama")
IMPLEMENTATIONS = ("hkvsim", "vllm", "both")
BACKENDS = ("sim", "nixl")
_MERGES = {"hkvsim": ("off", "contiguous", "strided"), "vllm": ("off",), "both": ("off",)}
_HYBRID = ("tiny-kimi-linear", "tiny-qwen3-next", "kimi-linear-48b", "qwen3-next-80b")
_MLA = ("tiny-deepseek", "deepseek-v3")
_GQA = ("tiny-llama", "llama-3.1-8b", "tiny-qwen3-next", "qwen3-next-80b")
# (kind, phase) pairs a fault may take; kill-rank and disconnect-peer fire when the targeted
# request posts to the targeted rank
_FAULTS = (("drop-notification", None), ("delay-notification", None),
           ("fail-transfer", "completion"), ("fail-transfer", "setup"), ("fail-transfer", "poll"),
           ("stall-transfer", None), ("disconnect-peer", None), ("kill-rank", None),
           ("slow-link", None), ("expire-lease-early", None),
           ("abort-request", "on-prefill"), ("abort-request", "before-scheduling"),
           ("abort-request", "during-handshake"), ("abort-request", "mid-transfer"),
           ("abort-request", "after-completion"))


@dataclass(frozen=True)
class FuzzOptions:
    seed: int = 0
    count: int = 50
    presets: tuple[str, ...] = FUZZ_PRESETS
    max_requests: int = 6
    max_prompt_tokens: int = 3000
    faults: bool = False
    quirk: str | None = None
    implementation: str = "hkvsim"
    determinism: bool = False
    scenario_timeout: float = 120.0  # wall seconds per run
    backend: str = "sim"  # sim: the simulated fabric; nixl: real NIXL agents, a process per rank
    max_ranks: int = 8  # backend nixl: a deployment of more rank processes is skipped
    time_limit: float | None = None  # wall seconds for the whole fuzz: no new scenario after it

    def __post_init__(self) -> None:
        problems = []
        if self.count < 1:
            problems.append(f"count {self.count}: allowed: >= 1")
        if self.seed < 0:
            problems.append(f"seed {self.seed}: allowed: >= 0")
        if not self.presets:
            problems.append("presets: allowed: at least one preset")
        if self.max_requests < 1:
            problems.append(f"max_requests {self.max_requests}: allowed: >= 1")
        if self.max_prompt_tokens < 2:
            problems.append(f"max_prompt_tokens {self.max_prompt_tokens}: allowed: >= 2")
        if self.implementation not in IMPLEMENTATIONS:
            problems.append(f"implementation {self.implementation!r}: allowed: "
                            f"{', '.join(IMPLEMENTATIONS)}")
        if self.quirk is not None and self.implementation != "hkvsim":
            problems.append(f"quirk {self.quirk!r} with implementation "
                            f"{self.implementation!r}: quirks replay bugs in hkvsim's core; "
                            "allowed only with implementation hkvsim")
        if self.backend not in BACKENDS:
            problems.append(f"backend {self.backend!r}: allowed: {', '.join(BACKENDS)}")
        elif self.backend == "nixl":
            if self.faults:
                problems.append("faults with backend nixl: the real backend injects only some "
                                "fault kinds, and only with engine and rank targets; allowed "
                                "only with backend sim")
            if self.determinism:
                problems.append("determinism with backend nixl: its times are wall-clock; "
                                "allowed only with backend sim")
        if self.max_ranks < 2:
            problems.append(f"max_ranks {self.max_ranks}: allowed: >= 2 (a prefill and a "
                            "decode rank)")
        if not self.scenario_timeout > 0:
            problems.append(f"scenario_timeout {self.scenario_timeout}: allowed: > 0 seconds")
        if self.time_limit is not None and not self.time_limit > 0:
            problems.append(f"time_limit {self.time_limit}: allowed: > 0 seconds")
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class Finding:
    kind: str  # corruption | hang | leak | not-ok | crash | timeout | nondeterministic | diff
    implementation: str  # hkvsim | vllm | both (a diff)
    detail: str
    signature: str  # what groups findings: the kind, its gist, the model and the mode
    fields: tuple[str, ...] = ()  # a diff: the fields that differ
    outcomes: tuple[str, str] | None = None  # a diff: (hkvsim's, vLLM's) run outcome
    known: str | None = None  # the documented vLLM finding that explains it (fuzz_known)
    # a diff: vLLM moved fewer bytes than hkvsim's core in every request whose bytes differ
    # (None: not recorded, as in reports written before it was)
    vllm_moved_less: bool | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "implementation": self.implementation,
                "detail": self.detail, "signature": self.signature, "known": self.known} | (
                    {"fields": list(self.fields), "outcomes": list(self.outcomes),
                     "vllm_moved_less": self.vllm_moved_less}
                    if self.outcomes is not None else {})


def vllm_moved_less(diffs: Sequence[Any]) -> bool:
    """Whether vLLM moved fewer bytes than hkvsim's core in every request whose bytes differ
    (``diffs``: ``compare_results``' differences; False where no request's bytes differ)."""
    nbytes = [d for d in diffs if d.field == "nbytes"]
    return bool(nbytes) and all(d.vllm < d.hkvsim for d in nbytes)


def diff_finding(diffs: Sequence[Any], core: Any, vllm: Any, where: str) -> Finding:
    """The finding ``diffs`` (``compare_results`` of hkvsim's core's run ``core`` and vLLM's
    run ``vllm``) make, signed by ``where`` (the model and the mode)."""
    fields = sorted({d.field for d in diffs})
    pair = (core.outcome, vllm.outcome)
    return Finding(
        "diff", "both", "; ".join(str(d) for d in diffs[:6])
        + (f" (and {len(diffs) - 6} more)" if len(diffs) > 6 else ""),
        f"both: diff: {', '.join(fields)} (hkvsim {pair[0]}, vllm {pair[1]}) | {where}",
        fields=tuple(fields), outcomes=pair, vllm_moved_less=vllm_moved_less(diffs))


@dataclass
class FuzzCase:
    index: int
    text: str
    preset: str
    mode: str
    faulty: bool
    status: str = "pending"  # checked | skipped | refused-input
    reason: str | None = None  # why skipped or refused
    outcomes: dict[str, str] = field(default_factory=dict)  # implementation -> run outcome
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "preset": self.preset, "mode": self.mode,
                "faulty": self.faulty, "status": self.status, "reason": self.reason,
                "outcomes": self.outcomes, "seconds": round(self.seconds, 3),
                "findings": [f.as_dict() for f in self.findings]}


# ---- generation -------------------------------------------------------------------------------
def _prompt(rng: random.Random, max_tokens: int) -> int:
    """Anywhere, or on either side of a block boundary (N - 1 or N filling whole blocks, where
    decode's block list and prefill's can differ by one)."""
    if rng.random() < 0.5:
        return rng.randint(2, max_tokens)
    block = rng.choice((16, 32, 64, 80, 192))
    n = rng.randint(1, max(1, max_tokens // block)) * block + rng.choice((-1, 0, 1))
    return min(max(2, n), max_tokens)


def generate(seed: int, index: int, options: FuzzOptions) -> tuple[str, str, str, bool]:
    """(scenario TOML, preset, mode, has faults) of scenario ``index`` of ``seed``: a pure
    function of its arguments (the random stream is seeded with both)."""
    rng = random.Random(f"hkvsim-fuzz:{seed}:{index}")
    preset = rng.choice(options.presets)
    p_tp, d_tp = rng.choice((1, 2, 4, 8)), rng.choice((1, 2, 4, 8))
    mode = rng.choice(("pull", "push"))
    prefill: list[str] = []
    decode: list[str] = []
    # block size ratios (decode's blocks a multiple of prefill's) where the rules allow them
    if preset in _MLA and rng.random() < 0.35:
        prefill += ['attention_backend = "triton-mla"', "block_size = 16"]
        decode += ['attention_backend = "triton-mla"',
                   f"block_size = {16 * rng.choice((1, 2, 4))}"]
    elif preset in _GQA and ((mode == "pull" and p_tp <= d_tp) or p_tp == d_tp) \
            and rng.random() < 0.35:
        prefill.append("block_size = 16")
        decode.append(f"block_size = {16 * rng.choice((1, 2, 4))}")
    for side in (prefill, decode):
        if rng.random() < 0.25:
            side.append(f"instances = {rng.randint(2, 3)}")
        if rng.random() < 0.4:
            side.append('block_ids = "warmed"')
            if rng.random() < 0.5:
                side.append(f"warmup_requests = {rng.randint(1, 300)}")
    n = rng.randint(1, options.max_requests)
    prompts = [_prompt(rng, options.max_prompt_tokens) for _ in range(n)]
    # prefix caching where it is allowed (a hybrid needs the same ppl on both sides: rule V4)
    caching = (preset not in _HYBRID or (p_tp == d_tp and prefill == decode)) \
        and rng.random() < 0.35
    if caching:
        prefill.append("prefix_caching = true")
        decode.append("prefix_caching = true")
    connector = [f'mode = "{mode}"',
                 f'registration_order = "{rng.choice(("sorted", "state-first", "attention-first"))}"',
                 # vLLM's connector posts a descriptor per block whatever hkvsim's merge option
                 # says: against it, merging would only differ in counts, never in bytes
                 f'descriptor_merge = "{rng.choice(_MERGES[options.implementation])}"']
    if options.quirk is not None:
        connector.append(f'quirks = ["{options.quirk}"]')
    if options.implementation == "vllm":  # the file then reproduces the run by itself
        connector.append('implementation = "vllm"')
    # hkvsim's core alone: half the files move only what a request needs (transfer_extent, what
    # vLLM 0.34.0 moves). Beside vLLM the core takes the release's extent instead. Drawn from
    # a stream of its own, so every other draw of the file is unchanged
    if options.implementation == "hkvsim" and random.Random(
            f"hkvsim-fuzz-extent:{seed}:{index}").random() < 0.5:
        connector.append('transfer_extent = "needed"')
    workload = [f"requests = {n}", f"prompt_tokens = {prompts}"]
    if caching:
        workload.append("prefix_hit_tokens = "
                        f"{[rng.choice((0, p - 1, (p - 1) // 2)) for p in prompts]}")
    if rng.random() < 0.5:
        workload += ['arrival = "poisson"', f"rate = {rng.choice((10, 100, 1000, 10000))}"]
    if rng.random() < 0.35:
        workload.append(f"max_inflight = {rng.randint(1, 3)}")
    faults: list[str] = []
    if options.faults:
        connector += [f"lease_seconds = {rng.choice((0.5, 5.0))}",
                      f"transfer_timeout_seconds = {rng.choice((0.05, 60.0))}",
                      f'kv_load_failure_policy = "{rng.choice(("fail", "recompute"))}"']
        for _ in range(rng.randint(1, 2)):
            kind, phase = rng.choice(_FAULTS)
            targets = [f"request = {rng.randrange(n)}"]
            if options.implementation != "both":
                # a chance is drawn per matching event, and two connectors meet a different
                # number of them: side by side, only targets that do not draw
                targets.append("probability = 0.5")
            if kind not in REQUEST_ONLY_FAULTS:
                targets.append("rank = 0\nprobability = 1.0")
            faults.append(f'\n[[faults]]\nkind = "{kind}"\n{rng.choice(targets)}\n'
                          + (f'phase = "{phase}"\n' if phase else ""))
    lines = [
        "[scenario]", f'name = "fuzz seed {seed} scenario {index}"',
        f"seed = {rng.randint(0, 10_000)}",
        "[model]", f'preset = "{preset}"',
        "[prefill]", f"tp = {p_tp}", *prefill,
        "[decode]", f"tp = {d_tp}", *decode,
        "[connector]", *connector,
        "[workload]", *workload,
    ]
    return "\n".join(lines) + "\n" + "".join(faults), preset, mode, bool(faults)


# ---- checks -----------------------------------------------------------------------------------
def _indices(records: list[Any], keep: Callable[[Any], bool]) -> str:
    idx = [r.index for r in records if keep(r)]
    shown = ", ".join(str(i) for i in idx[:8]) + (f" (and {len(idx) - 8} more)"
                                                  if len(idx) > 8 else "")
    return f"{len(idx)} request(s): {shown}"


def check_run(result: Any, *, faulty: bool, implementation: str, where: str) -> list[Finding]:
    """The rules a run ``result`` (a RunResult) broke; ``where`` ("tiny-llama push") joins
    each finding's signature. Corruption, hangs and leaks are findings whatever the faults;
    without faults, so is any outcome but ``ok``."""
    out: list[Finding] = []

    def add(kind: str, gist: str, detail: str) -> None:
        out.append(Finding(kind, implementation, detail,
                           f"{implementation}: {kind}: {gist} | {where}"))

    records = result.records
    if result.corrupted:
        add("corruption", "reported successful with wrong bytes",
            "reported successful with wrong bytes: "
            + _indices(records, lambda r: r.corrupted))
    if result.late_landings or result.stray_writes:
        add("corruption", "bytes landed in blocks the request did not own",
            f"{result.late_landings} late landing(s), {result.stray_writes} stray write(s) "
            "into blocks their request did not own")
    if result.hung:
        add("hang", "requests never ended",
            "never ended: " + _indices(records, lambda r: r.status == "pending"))
    leaks = {k: v for k, v in result.leaks.items() if v}
    if leaks:
        add("leak", ", ".join(sorted(leaks)), f"left behind: {leaks}")
    if not faulty and not out and result.outcome != "ok":
        if result.handshake_errors:
            add("not-ok", "handshake refused",
                f"handshake refused a deployment the rules accept: {result.handshake_errors[0]}")
        else:
            classes = Counter(r.failure_class or r.status for r in records if r.status != "ok")
            lease = sum(r.freed_by_lease for r in records)
            gist = ", ".join(sorted(classes)) or ("lease expired" if lease else result.outcome)
            first = next((r for r in records if r.status != "ok"), None)
            add("not-ok", f"{result.outcome} ({gist})",
                f"outcome {result.outcome} without faults: {dict(classes)}"
                + (f", {lease} freed by lease" if lease else "")
                + (f"; request {first.index}: {first.failure_class}: {first.reason}"
                   if first is not None else ""))
    return out


def _fingerprint(result: Any) -> str:
    """What two runs of one file must agree on."""
    return json.dumps([result.outcome, result.sim_seconds, result.handshake_errors,
                       [(r.status, r.failure_class, r.descriptors, r.nbytes, r.transfers,
                         r.mismatched_words, sorted(r.times.items())) for r in result.records]],
                      default=str)


# ---- running ----------------------------------------------------------------------------------
class _Timeout(Exception):
    pass


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise _Timeout in the main thread after ``seconds`` of wall time (elsewhere: no limit;
    signals reach only the main thread). An alarm already set (pytest-timeout's, a caller's) is
    kept: if it is due first its handler runs when it is due, and either way it is re-armed for
    the time it has left when this ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    outer_first = 0 < outer_delay < seconds
    start = time.monotonic()

    def fire(signum: int, frame: Any) -> None:
        if outer_first and callable(outer_handler):
            outer_handler(signum, frame)
            return
        raise _Timeout()

    outer_handler = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, outer_delay if outer_first else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_delay > 0 and not (outer_first and time.monotonic() - start >= outer_delay):
            left = outer_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_interval)


def _crash(exc: BaseException) -> str:
    """An exception's type and the innermost frame it came from (file:line)."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}{at}"


def _run(scenario: Any) -> Any:
    from .cluster import run_scenario

    return run_scenario(scenario)


def _nixl_runner(timeout: float) -> Callable[[Any], Any]:
    """Runs over real NIXL agents (one process per rank, DRAM over UCX on loopback), the
    workload bounded by the driver's own deadline (no SIGALRM across its rank processes)."""
    from .drivers.nixl import NixlRunOptions, run_scenario_nixl
    from .transport.nixl import load_nixl

    load_nixl()  # NixlUnavailable: the whole fuzz cannot run here, said once
    options = NixlRunOptions(run_timeout=timeout)
    return lambda scenario: run_scenario_nixl(scenario, options=options)


def run_case(case: FuzzCase, options: FuzzOptions, *, run: Callable[[Any], Any] = _run,
             vllm_version: list[str] | None = None) -> None:
    """Run ``case`` as ``options`` say and record its outcomes and findings in it."""
    from .implementations.diff import compare_results, with_implementation

    t0 = time.perf_counter()
    where = f"{case.preset} {case.mode}"
    try:
        (scenario,) = parse_scenarios(case.text, source=f"fuzz scenario {case.index}")
    except ScenarioError as exc:
        case.status, case.reason = "refused-input", str(exc)
        return
    from .memory_estimate import MemoryGuardError, check_fits

    try:  # the memory guard of `hkvsim run`: a drawn run that cannot fit is refused, not run
        check_fits(scenario, timing_only=False)
    except MemoryGuardError as exc:
        case.status, case.reason = "refused-input", str(exc)
        return
    real = options.backend == "nixl"
    ranks = sum(section.tp * section.instances for section in (scenario.prefill, scenario.decode))
    if real and ranks > options.max_ranks:
        case.status = "skipped"
        case.reason = (f"{ranks} rank processes on real NIXL, above --max-ranks "
                       f"{options.max_ranks}")
        case.seconds = time.perf_counter() - t0
        return
    names = ("hkvsim", "vllm") if options.implementation == "both" else (options.implementation,)
    results: dict[str, Any] = {}
    # beside a vLLM release, hkvsim's core moves what that release moves (transfer_extent)
    like = vllm_version[0] if vllm_version and options.implementation == "both" else None
    for name in names:
        s = with_implementation(scenario, name, like_vllm=like)
        try:
            with (contextlib.nullcontext() if real else _deadline(options.scenario_timeout)):
                results[name] = run(s)
                if options.determinism:
                    again = run(s)
                    if _fingerprint(again) != _fingerprint(results[name]):
                        case.findings.append(Finding(
                            "nondeterministic", name, "a second run of the same file gave "
                            "other statuses, descriptors, bytes or simulated times",
                            f"{name}: nondeterministic | {where}"))
        except _Timeout:
            case.findings.append(Finding(
                "timeout", name, f"the run took more than {options.scenario_timeout:g} s of "
                "wall time", f"{name}: timeout | {where}"))
            continue
        except ScenarioError as exc:
            # vLLM's harness cannot run this deployment, or the generator drew one that the
            # input checks refuse (a pool too small): not a finding, but said
            if name == "vllm" and exc.key == "connector.implementation":
                case.status, case.reason = "skipped", exc.problem
            else:
                case.status, case.reason = "refused-input", str(exc)
            case.seconds = time.perf_counter() - t0
            return
        except Exception as exc:  # noqa: BLE001 - a crash is what the fuzz looks for
            case.findings.append(Finding(
                "crash", name, f"{_crash(exc)}: {exc}"[:500],
                f"{name}: crash: {_crash(exc)} | {where}"))
            continue
        result = results[name]
        case.outcomes[name] = result.outcome
        if name == "vllm" and vllm_version is not None and result.implementation:
            vllm_version[:] = [result.implementation.get("version", "?")]
        case.findings += check_run(result, faulty=case.faulty, implementation=name, where=where)
    if len(results) == 2:
        diffs = compare_results(scenario.scenario.name, results["hkvsim"], results["vllm"])
        if diffs:
            case.findings.append(diff_finding(diffs, results["hkvsim"], results["vllm"], where))
    if case.findings and options.implementation != "hkvsim":
        from .fuzz_known import explain, facts

        deployment = facts(scenario)
        version = vllm_version[0] if vllm_version else None
        case.findings = [dataclasses.replace(f, known=explain(f, deployment, version))
                         for f in case.findings]
    case.status = "checked"
    case.seconds = time.perf_counter() - t0


@dataclass
class FuzzReport:
    options: FuzzOptions
    cases: list[FuzzCase]
    seconds: float
    stopped_early: bool  # the time limit ended it before count scenarios
    vllm_version: str | None = None

    @property
    def findings(self) -> list[tuple[FuzzCase, Finding]]:
        return [(c, f) for c in self.cases for f in c.findings]

    @property
    def new_findings(self) -> list[tuple[FuzzCase, Finding]]:
        """The findings no documented vLLM finding explains (all of hkvsim's own)."""
        return [(c, f) for c, f in self.findings if f.known is None]

    def groups(self) -> list[dict[str, Any]]:
        """Findings by signature; ``known``: the documented findings that explain the group's
        findings (``null`` among them for a finding none explains)."""
        by: dict[str, list[int]] = {}
        known: dict[str, set[str | None]] = {}
        for case, finding in self.findings:
            ids = by.setdefault(finding.signature, [])
            known.setdefault(finding.signature, set()).add(finding.known)
            if case.index not in ids:
                ids.append(case.index)
        return [{"signature": sig, "scenarios": len(ids), "example": ids[0], "indices": ids,
                 "known": sorted(known[sig], key=lambda k: (k is None, k or ""))}
                for sig, ids in sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[0]))]

    @property
    def core_extent(self) -> str | None:
        """The transfer extent hkvsim's core ran with beside vLLM (None: not both ran)."""
        if self.options.implementation != "both":
            return None
        from .implementations.vllm.engine import release_transfer_extent

        return (release_transfer_extent(self.vllm_version) if self.vllm_version
                else "allocated")

    def as_dict(self) -> dict[str, Any]:
        o = self.options
        status = Counter(c.status for c in self.cases)
        return {"seed": o.seed, "count": o.count, "ran": len(self.cases),
                "stopped_early": self.stopped_early, "implementation": o.implementation,
                "vllm_version": self.vllm_version,
                # what hkvsim's core moved beside vLLM (with_implementation's like_vllm)
                "hkvsim_transfer_extent": self.core_extent,
                "quirk": o.quirk, "faults": o.faults,
                "determinism": o.determinism, "presets": list(o.presets), "backend": o.backend,
                "seconds": round(self.seconds, 2),
                "checked": status.get("checked", 0), "skipped": status.get("skipped", 0),
                "refused_input": status.get("refused-input", 0),
                "skip_reasons": dict(Counter(c.reason for c in self.cases
                                             if c.status == "skipped")),
                "outcomes": {name: dict(Counter(c.outcomes[name] for c in self.cases
                                                if name in c.outcomes))
                             for name in ("hkvsim", "vllm")
                             if any(name in c.outcomes for c in self.cases)},
                "findings": len(self.findings),
                "new_findings": len(self.new_findings),
                "scenarios_with_findings": sum(bool(c.findings) for c in self.cases),
                "scenarios_with_new_findings": len({c.index for c, _ in self.new_findings}),
                "groups": self.groups(),
                "cases": [c.as_dict() for c in self.cases]}


def reproduce_command(options: FuzzOptions, path: str, version: str | None) -> str:
    backend = " --backend nixl" if options.backend == "nixl" else ""
    if options.implementation == "hkvsim":
        return f"hkvsim run{backend} {path}"
    wrap = f"scripts/with-vllm {version or 'VERSION'} "
    if options.implementation == "both":
        return f"{wrap}hkvsim diff{backend} {path}"
    return f"{wrap}hkvsim run{backend} {path}"


def finding_file(case: FuzzCase, options: FuzzOptions, version: str | None, name: str) -> str:
    """A finding's scenario as a file that reproduces it, its findings in the header."""
    head = [f"# hkvsim fuzz --seed {options.seed}: scenario {case.index} "
            f"(implementation {options.implementation}"
            + (f", vLLM {version}" if version and options.implementation != "hkvsim" else "")
            + (f", quirk {options.quirk}" if options.quirk else "")
            + (", real NIXL" if options.backend == "nixl" else "") + ")"]
    for f in case.findings:
        head.append(f"# found ({f.implementation}): {f.kind}: {f.detail}"[:400])
        if f.known is not None:
            head.append(f"#   known: {f.known}")
    head.append(f"# reproduce: {reproduce_command(options, name, version)}")
    return "\n".join(head) + "\n" + case.text


def fuzz(options: FuzzOptions, *, out_dir: Path | None = None,
         on_case: Callable[[FuzzCase], None] | None = None,
         run: Callable[[Any], Any] = _run) -> FuzzReport:
    """Generate and run ``options.count`` scenarios (fewer when ``time_limit`` ends it) and
    write findings and ``fuzz.json`` to ``out_dir`` when given."""
    start = time.perf_counter()
    if options.backend == "nixl" and run is _run:
        run = _nixl_runner(options.scenario_timeout)
    cases: list[FuzzCase] = []
    version: list[str] = []
    if options.implementation == "both":  # known before the first run: the core's extent
        from .implementations.vllm.engine import vllm_version

        installed = vllm_version()
        version = [installed] if installed else []
    stopped = False
    for index in range(options.count):
        if options.time_limit is not None and time.perf_counter() - start >= options.time_limit:
            stopped = True
            break
        text, preset, mode, faulty = generate(options.seed, index, options)
        case = FuzzCase(index=index, text=text, preset=preset, mode=mode, faulty=faulty)
        run_case(case, options, run=run, vllm_version=version)
        cases.append(case)
        if on_case is not None:
            on_case(case)
    report = FuzzReport(options, cases, time.perf_counter() - start, stopped,
                        version[0] if version else None)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        for case in cases:
            if case.findings:
                name = f"finding-{case.index:04d}.toml"
                (out_dir / name).write_text(finding_file(case, options, report.vllm_version,
                                                         str(out_dir / name)))
        (out_dir / "fuzz.json").write_text(json.dumps(report.as_dict(), indent=1) + "\n")
    return report
