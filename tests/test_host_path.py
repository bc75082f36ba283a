"""The host-path model (a node's CPU cores as a FIFO pool for dispatch, post, copy, completion
and oracle work) and its
calibration gate (hkvsim/validate_fit.py): fit on a FIT set, refuse on held-out error."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import simpy

from host_profiles import CPU_BASE

from hkvsim.fabric import Endpoint, Fabric, ProfileError, load_profile
from hkvsim.fabric.topology import route
from hkvsim.validate import FileResult

ROOT = Path(__file__).resolve().parents[1]
CPU = str(CPU_BASE)  # the shipped profile without its host-path block
HOST = {"host_copy_cores": 2, "host_copy_core_gbps": 1.0}


def _copies(profile: Any, pairs: list[tuple[str, str]], nbytes: int, *,
             nodes: dict[str, int] | None = None) -> list[Any]:
    """Timings of concurrent one-descriptor transfers started together (initiator = src)."""
    env = simpy.Environment()
    names = sorted({k for p in pairs for k in p})
    nodes = nodes or {}
    fabric = Fabric(env, profile, {k: Endpoint(nodes.get(k, 0), i) for i, k in enumerate(names)})
    events = [fabric.transfer(initiator=a, src=a, dst=b, nbytes=nbytes, descriptors=1)
              for a, b in pairs]
    env.run()
    return [e.value for e in events]


def test_optional_keys_absent_leave_the_path_as_before() -> None:
    p = load_profile(CPU)
    assert p.host_cores is None and p.completion_overhead == 0.0 and p.rank_dispatch == 0.0
    r = route(p, Endpoint(0, 0), Endpoint(0, 1))
    assert [n for n, _ in r.links] == ["n0g0.nvl.tx", "n0g1.nvl.rx"]
    gpu = load_profile("h200-nvlink")
    assert gpu.host_cores is None and gpu.oracle_core_bandwidth is None
    # without the host model four transfers between distinct rank pairs do not slow each other
    free = _copies(p, [("a", "b"), ("c", "d"), ("e", "f"), ("g", "h")], 10**8)
    assert [t.wire_time for t in free] == pytest.approx([10**8 / p.intra_node_bandwidth] * 4,
                                                         rel=1e-9)


def test_copies_queue_for_the_node_cores_first_come_first_served() -> None:
    p = load_profile(CPU, overrides=HOST)  # 2 cores, 1 GB/s each
    assert p.host_cores == 2
    r = route(p, Endpoint(0, 0), Endpoint(0, 1))
    assert [n for n, _ in r.links] == ["n0g0.nvl.tx", "n0g1.nvl.rx"]  # no shared cpu link
    nbytes = 10**8
    one_core = nbytes / 1e9 + p.post_time(1)
    # one transfer alone: one core copies at the per-core rate, not the 5.7 GB/s link
    (alone,) = _copies(p, [("a", "b")], nbytes)
    assert alone.wire_time == pytest.approx(nbytes / 1e9, rel=1e-9)
    # four transfers of four distinct ranks, two cores: two run, two wait for a core, and the
    # waiting ones start when the first two end (a fair-shared link would slow all four alike)
    four = _copies(p, [("a", "b"), ("c", "d"), ("e", "f"), ("g", "h")], nbytes)
    assert [t.post_start for t in four] == pytest.approx([0, 0, one_core, one_core], abs=1e-12)
    assert [t.wire_end for t in four] == pytest.approx([one_core, one_core, 2 * one_core,
                                                        2 * one_core], rel=1e-9)
    assert all(t.wire_time == pytest.approx(nbytes / 1e9, rel=1e-9) for t in four)


def test_nodes_have_their_own_cores() -> None:
    p = load_profile(CPU, overrides={**HOST, "host_copy_cores": 1, "gpus_per_node": 4})
    nbytes = 10**8
    same = _copies(p, [("a", "b"), ("c", "d")], nbytes, nodes={"a": 0, "b": 0, "c": 0, "d": 0})
    assert same[1].post_start == pytest.approx(same[0].wire_end)  # one core: the second waits
    apart = _copies(p, [("a", "b"), ("c", "d")], nbytes, nodes={"a": 0, "b": 1, "c": 1, "d": 0})
    assert [t.post_start for t in apart] == [0.0, 0.0]  # initiators on two nodes: no wait


def test_dispatch_runs_on_the_core_before_the_post() -> None:
    p = load_profile(CPU, overrides={**HOST, "host_copy_cores": 1, "rank_dispatch_us": 300.0})
    first, second = _copies(p, [("a", "b"), ("c", "d")], 10**6)
    assert first.post_start == pytest.approx(300e-6)
    # the second rank's dispatch waits for the only core: copy of the first included
    assert second.post_start == pytest.approx(first.wire_end + 300e-6, rel=1e-9)


def test_completion_work_queues_behind_copies_holding_the_cores() -> None:
    p = load_profile(CPU, overrides={**HOST, "host_copy_cores": 1,
                                     "completion_notice_us": 100.0,
                                     "coordinator_message_us": 10.0})
    first, second = _copies(p, [("a", "b"), ("c", "d")], 10**8)
    # the first copy's completion notice needs the core the second copy now holds
    assert first.wire_end <= second.post_start
    assert first.done >= second.wire_end + 110e-6
    # with a core each, it completes right after its own copy
    two = load_profile(CPU, overrides={**HOST, "completion_notice_us": 100.0,
                                       "coordinator_message_us": 10.0})
    first, _ = _copies(two, [("a", "b"), ("c", "d")], 10**8)
    assert first.done == pytest.approx(first.wire_end + p.intra_node_latency + 110e-6)


def _thread_order(order: str | None, arrivals: list[tuple[float, str]] | None = None,
                  peer_delay: float | None = None, progress: Any = None) -> dict[str, float]:
    """When each piece of rank a's work ends (a transfer T*: when it is done; oracle work W*:
    1 ms of CPU). Default arrivals: W0 on an idle thread at 0; T1 (50 us dispatch, 1 ms copy)
    and W1 at 0.1 / 0.2 ms, during W0; W2 and T2 at 1.5 / 1.6 ms, during T1's copy.
    ``peer_delay``: the remote progresses that long after each post starts (or ``progress``,
    the fabric's peer_progress callable, as given)."""
    extra = {} if order is None else {"rank_thread_order": order}
    p = load_profile(CPU, overrides={**HOST, "host_copy_cores": 4, "completion_notice_us": 100.0,
                                     "rank_dispatch_us": 50.0, **extra})
    env = simpy.Environment()
    fabric = Fabric(env, p, {"a": Endpoint(0, 0), "b": Endpoint(0, 1)})
    ends: dict[str, float] = {}
    if peer_delay is not None:
        progress = lambda start, median=False: start + peer_delay  # noqa: E731

    def at(when: float, name: str) -> Any:
        yield env.timeout(when)
        if name.startswith("T"):
            timing = yield fabric.transfer(initiator="a", src="a", dst="b", nbytes=10**6,
                                           descriptors=1, peer_progress=progress)
            ends[name] = timing.done
        else:
            yield fabric.cpu_work("a", 1e-3)
            ends[name] = env.now

    for when, name in arrivals or [(0.0, "W0"), (1e-4, "T1"), (2e-4, "W1"), (1.5e-3, "W2"),
                                   (1.6e-3, "T2")]:
        env.process(at(when, name))
    env.run()
    return ends


def test_rank_thread_fifo_notices_a_completion_after_everything_queued_before_it() -> None:
    for order in (None, "fifo"):
        ends = _thread_order(order)
        # W0 | T1 (50 us dispatch + post + 1 ms copy) | W1 | W2 | T2 | T1's notice | T2's notice
        assert ends["W1"] < ends["W2"] < ends["T1"]
        assert ends["T1"] > ends["T2"] - 1e-3  # behind T2's whole post and copy


def test_rank_loop_batches_notice_a_completion_at_the_end_of_its_batch() -> None:
    ends = _thread_order("loop-batches")
    post = 50e-6 + load_profile(CPU).post_time(1) + 1e-3
    # batch 1: W0; batch 2: T1 and W1 (both arrived during W0), then the poll noticing T1;
    # batch 3: W2 and T2 (arrived during batch 2), then T2's notice
    assert ends["W0"] == pytest.approx(1e-3)
    assert ends["W1"] == pytest.approx(1e-3 + post + 1e-3)
    assert ends["T1"] == pytest.approx(ends["W1"] + 100e-6, abs=1e-6)
    assert ends["W2"] == pytest.approx(ends["W1"] + 100e-6 + 1e-3)
    assert ends["T2"] > ends["W2"] + post
    fifo = _thread_order("fifo")
    assert ends["T1"] < fifo["T1"] - 1e-3  # not behind W2 and T2


def test_rank_loop_batches_notice_a_completion_seen_at_its_posts_batch_end_first() -> None:
    # T1 alone in its batch, W2 arriving during its copy: the thread is free for W2 the instant
    # T1's post returns, but the loop polls NIXL first (its completion was there already)
    arrivals = [(0.0, "T1"), (5e-4, "W2")]
    post = 50e-6 + load_profile(CPU).post_time(1) + 1e-3
    ends = _thread_order("loop-batches", arrivals)
    assert ends["T1"] == pytest.approx(post + 100e-6, abs=1e-6)
    assert ends["W2"] == pytest.approx(post + 100e-6 + 1e-3, abs=1e-6)
    assert _thread_order("fifo", arrivals)["T1"] == pytest.approx(post + 1e-3 + 100e-6, abs=1e-6)


def test_rank_loop_batches_a_remote_that_likely_progressed_during_the_post_counts() -> None:
    # the remote's next poll: its median before T1's post returns, its mean 9 us after: the
    # poll ending T1's batch sees the completion (the likelier outcome), ahead of W2's batch
    post = 50e-6 + load_profile(CPU).post_time(1) + 1e-3
    progress = lambda start, median=False: start if median else post + 9e-6  # noqa: E731
    arrivals = [(0.0, "T1"), (5e-4, "W2")]
    ends = _thread_order("loop-batches", arrivals, progress=progress)
    assert ends["T1"] == pytest.approx(post + 9e-6 + 100e-6, abs=1e-6)
    assert ends["W2"] == pytest.approx(ends["T1"] + 1e-3, abs=1e-6)
    # (deciding on the mean would miss that poll, as FIFO does: the completion behind W2)
    assert _thread_order("fifo", arrivals, progress=progress)["T1"] > post + 1e-3


def test_rank_loop_batches_a_late_completion_goes_to_the_batch_running_then() -> None:
    # T1 (batch 1) completes 1.6 ms after its post starts (the remote's progress), while W1
    # (batch 2, arrived during T1) runs; W2 arrived during W1 (batch 3), before the completion:
    # the poll ending batch 2 notices T1, ahead of W2
    arrivals = [(0.0, "T1"), (5e-4, "W1"), (1.3e-3, "W2")]
    ends = _thread_order("loop-batches", arrivals, peer_delay=1.6e-3)
    post = 50e-6 + load_profile(CPU).post_time(1) + 1e-3
    assert ends["W1"] == pytest.approx(post + 1e-3)
    assert ends["T1"] == pytest.approx(ends["W1"] + 100e-6, abs=1e-6)
    assert ends["W2"] == pytest.approx(ends["T1"] + 1e-3, abs=1e-6)
    fifo = _thread_order("fifo", arrivals, peer_delay=1.6e-3)
    assert fifo["T1"] == pytest.approx(fifo["W2"] + 100e-6, abs=1e-6)  # behind W2 too


def test_oracle_work_costs_a_core_in_verified_runs_only() -> None:
    from hkvsim.drivers.sim import SimDriver
    from hkvsim.results import result_json
    from hkvsim.scenario import load_scenarios
    from hkvsim.validate import steady_transfer_mean, with_profile

    scenario = load_scenarios(ROOT / "scenarios/fit/deepseek-pull-1to2-burst3-warmed.toml")[0]
    base = {**HOST, "host_copy_core_gbps": 5.0, "completion_notice_us": 100.0}
    slow = {**base, "oracle_core_gbps": 0.05}  # the oracle's work swamps the copies

    def transfer_ms(overrides: dict[str, Any], timing_only: bool) -> float:
        run = SimDriver(with_profile(scenario, CPU_BASE, overrides), timing_only=timing_only).run()
        data = result_json(run, requests=True)
        assert data["outcome"] == "ok"
        return steady_transfer_mean(data) * 1e3, run

    verified_free, _ = transfer_ms(base, False)
    verified_slow, run = transfer_ms(slow, False)
    assert run.mismatched_bytes == 0 and run.verified
    # the oracle's work holds the rank's thread: completions are noticed after it
    assert verified_slow > 1.5 * verified_free
    timing_free, _ = transfer_ms(base, True)
    timing_slow, _ = transfer_ms(slow, True)
    assert timing_slow == pytest.approx(timing_free)  # no oracle runs: nothing to charge


def test_completion_overheads_delay_transfers_not_notifications() -> None:
    p = load_profile(CPU, overrides={"completion_notice_us": 300.0,
                                     "coordinator_message_us": 20.0})
    assert p.completion_overhead == pytest.approx(320e-6)
    env = simpy.Environment()
    fabric = Fabric(env, p, {"a": Endpoint(0, 0), "b": Endpoint(0, 1)})
    ev = fabric.transfer(initiator="a", src="a", dst="b", nbytes=0, descriptors=0)
    note = fabric.notify("a", "b")
    env.run()
    t = ev.value
    assert t.done - t.wire_end == pytest.approx(p.intra_node_latency + 320e-6)
    assert note.value == pytest.approx(p.intra_node_latency + p.notification_latency)
    assert fabric.path_latency("a", "b") == p.intra_node_latency


@pytest.mark.parametrize("overrides, fragment", [
    ({"host_copy_cores": 2}, "go together"),
    ({"host_copy_core_gbps": 1.0}, "go together"),
    ({"host_copy_cores": 0, "host_copy_core_gbps": 1.0}, "'host_copy_cores' = 0: expected an "
                                                          "integer > 0"),
    ({"host_copy_cores": 2, "host_copy_core_gbps": -1}, "expected a finite number > 0"),
    ({"completion_notice_us": "x"}, "'completion_notice_us' = 'x'"),
    ({**HOST, "memory": "VRAM"}, "memory = 'DRAM' profiles only"),
    ({"rank_dispatch_us": 100.0}, "'rank_dispatch_us' without 'host_copy_cores'"),
    ({"oracle_core_gbps": 2.0}, "'oracle_core_gbps' without 'host_copy_cores'"),
    ({**HOST, "oracle_op_us": 900.0}, "'oracle_op_us' without 'oracle_core_gbps'"),
    ({"rank_op_dispatch_us": 300.0}, "'rank_op_dispatch_us' without 'host_copy_cores'"),
    ({**HOST, "rank_dispatch_us": -5}, "'rank_dispatch_us' = -5: expected a finite number > 0"),
    ({**HOST, "rank_thread_order": "lifo"}, "'rank_thread_order' = 'lifo': expected one of "
                                            "'fifo', 'loop-batches'"),
    ({"rank_thread_order": "fifo"}, "'rank_thread_order' without 'host_copy_cores'"),
])
def test_bad_host_keys_say_what_is_allowed(overrides: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ProfileError) as err:
        load_profile(CPU, overrides=overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_dataclass_checks_the_pairing_too() -> None:
    p = load_profile(CPU)
    with pytest.raises(ProfileError, match="go together"):
        replace(p, host_copy_cores=2)


# ---- the calibration gate ----------------------------------------------------------------------
def test_load_above_the_cores_is_refused_unless_forced() -> None:
    from hkvsim.validate_fit import LoadError, check_load

    with pytest.raises(LoadError, match=r"load average 5\.00 > 2 core\(s\).*--force"):
        check_load(force=False, cores=2, load=5.0)
    assert check_load(force=True, cores=2, load=5.0) == (5.0, 2)
    assert check_load(force=False, cores=2, load=1.5) == (1.5, 2)


def test_host_block_replaces_itself_and_loads(tmp_path: Path) -> None:
    from hkvsim.validate_fit import HostFit, host_block, replace_host_block

    meta = {"when": "now", "fit_source": "scenarios/fit/", "held_out_source": "v/",
            "fit_files": 5, "repeats": 3, "load_min": 0.5, "load_max": 1.0, "forced": False,
            "held_out_median": "10 %", "held_out_worst": "30 %"}
    base = CPU_BASE.read_text()  # the shipped profile without its host block
    once = replace_host_block(base, host_block(HostFit(2, 1.5, 250.0, 9.0, 300.0, 4.0), meta))
    twice = replace_host_block(once, host_block(HostFit(2, 2.5, 100.0, 9.0, 400.0, 3.5, 1000.0,
                                                        100.0, oracle_op_us=1200.0), meta))
    assert twice.count("host_copy_cores =") == 1 and "host_copy_core_gbps = 2.5" in twice
    assert twice.count("rank_dispatch_us =") == 1 and twice.count("oracle_core_gbps =") == 1
    path = tmp_path / "p.toml"
    path.write_text(twice)
    p = load_profile(path)
    assert (p.host_cores, p.host_copy_core_bandwidth) == (2, pytest.approx(2.5e9))
    assert p.rank_dispatch == pytest.approx(400e-6)
    assert p.oracle_core_bandwidth == pytest.approx(3.5e9)
    assert p.oracle_time(7_000_000) == pytest.approx(1.2e-3 + 2e-3)  # per op + bytes
    assert "oracle_op_us" not in once  # a fit without the term writes no key
    # the FIT set's candidates carry it too
    assert HostFit(2, 2.5, 100.0, 9.0, 400.0, 3.5, oracle_op_us=1200.0).overrides()[
        "oracle_op_us"] == 1200.0
    assert p.completion_overhead == pytest.approx(109e-6)
    assert replace_host_block(twice, None).strip() == base.strip()
    # the shipped profile's own block (written by calibrate --host) is replaced the same way
    shipped = (ROOT / "hkvsim/fabric/profiles/cpu-ucx-loopback.toml").read_text()
    assert replace_host_block(shipped, None).strip() == base.strip()


def _result(name: str, sim: float, real: float) -> FileResult:
    return FileResult(file=name, scenario=name, profile=CPU, sim_seconds=sim,
                      real_seconds=(real, real * 1.1, real * 0.9), loads=(0.5, 0.5, 0.5),
                      descriptors_posted=(1, 1), descriptors_coalesced=(1, 1),
                      outcomes=("ok",) * 4, rank_cpu={"posts": 10})


@pytest.mark.parametrize("held_err, accepted", [(0.10, True), (0.20, False)])
def test_calibrate_host_writes_only_within_the_held_out_bounds(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, held_err: float,
        accepted: bool) -> None:
    import hkvsim.validate_fit as vf

    fit_files = sorted((ROOT / "scenarios/fit").glob("*.toml"))[:2]
    held_files = sorted((ROOT / "scenarios/validation").glob("*.toml"))[:3]
    seen: list[Path | None] = []
    series: list[tuple[list[Path], int]] = []

    def fake_measure(files: list[Path], *, repeats: int, progress: Any,
                     warm_up: int) -> list[Any]:
        series.append((list(files), warm_up))
        return [f"real runs of {f.name}" for f in files]

    def fake_judge(files: list[Path], reals: list[Any], *, progress: Any,
                   profile: Path | None) -> list[FileResult]:
        seen.append(profile)
        assert reals == [f"real runs of {f.name}" for f in files]  # each file its own runs
        if files == fit_files:  # the FIT runs: sim on the input profile, real = 1 ms
            return [_result(str(f), 0.5e-3, 1e-3) for f in files]
        text = Path(profile).read_text()  # the candidate carries the fitted constants
        assert "host_copy_core_gbps = 1.0" in text
        assert 'rank_thread_order = "loop-batches"' in text  # the rank loop's order
        return [_result(str(f), 1e-3 * (1 + held_err), 1e-3) for f in files]

    monkeypatch.setattr(vf, "measure_real", fake_measure)
    monkeypatch.setattr(vf, "judge", fake_judge)
    monkeypatch.setattr(vf, "measure_coordinator_message", lambda: 10e-6)
    monkeypatch.setattr(vf, "measured_cpu", lambda results, unprepped: {
        "oracle_core_gbps": 4.0, "oracle_op_us": 0.0, "oracle_ops": 4, "rank_dispatch_us": 200.0,
        "rank_op_dispatch_us": 0.0, "rank_op_dispatch_unprepped_us": 300.0,
        "oracle_bytes": 4e6,
        "rank_dispatch_unprepped_us": 600.0, "unprepped_files": 1,
        "oracle_cpu_seconds": 1e-3, "start_ops": 10, "start_cpu_seconds": 3e-3, "posts": 10,
        "post_cpu_seconds": 1e-3, "coordinator_call_us": 50.0, "coordinator_calls": 20,
        "coordinator_cpu_seconds": 1e-3, "poll_cpu_us": 45.0, "poll_busy_cpu_us": 90.0,
        "poll_iterations": (400, 30)})
    monkeypatch.setattr(vf, "check_load", lambda force: (0.5, 2))
    monkeypatch.setattr(vf, "fit_host", lambda sc, real, **kw: (
        replace(kw["base"], core_gbps=1.0, completion_notice_us=100.0), [1e-3] * len(real)))
    out = tmp_path / "out.toml"
    result = vf.calibrate_host(fit_files, held_files, profile_in=ROOT / "hkvsim/fabric/"
                               "profiles/cpu-ucx-loopback.toml", profile_out=out,
                               report_dir=tmp_path / "rep", repeats=3, warm_up=2)
    assert result["accepted"] is accepted
    # one real series over both sets (interleaved: both see the same machine), after 2 passes
    assert series == [([*fit_files, *held_files], 2)]
    # the FIT set judged with the input profile, the held-out set with the candidate
    assert seen[0] == ROOT / "hkvsim/fabric/profiles/cpu-ucx-loopback.toml" != seen[1]
    assert out.exists() is accepted
    # an accepted calibration's report is host-path.md (the profile cites it); a refused one
    # is host-path-refused.md and leaves the accepted one alone
    stem = "host-path" if accepted else "host-path-refused"
    assert sorted(f.name for f in (tmp_path / "rep").iterdir()) == [f"{stem}.json", f"{stem}.md"]
    report = (tmp_path / f"rep/{stem}.md").read_text()
    assert "in one series over both sets" in report
    assert "after 2 warm-up pass(es) over both sets whose runs are left out" in report
    # how firmly the held-out runs decide it (validate.resampled_verdict), in the report too
    assert "Resampling each file's real runs (2,000 draws)" in report
    pct = f"{100 * held_err:.0f} %"
    assert (f"Held-out median |error| {pct}, worst {pct} (bounds: median <= 15 %, worst <= "
            f"40 %)") in report
    # (runs 10 % apart around 1 ms: an error of 10 % is met in most draws, 20 % in few)
    share = result["held_out_summary"]["resampled"]["met_share"]
    assert (share > 0.5) is accepted and 0 < share < 1
    assert f"the bounds are met in {100 * share:.0f} % of the draws" in report
    # the JSON keeps what a replay (calibrate --host --replay) refits and judges on
    from hkvsim.validate_fit import _stored_files

    stored = json.loads((tmp_path / f"rep/{stem}.json").read_text())
    assert [p.name for p, _ in _stored_files(stored, "fit_files")] == [f.name for f in fit_files]
    held_runs = [r for _, r in _stored_files(stored, "held_out_files")]
    assert held_runs == [(1e-3, 1e-3 * 1.1, 1e-3 * 0.9)] * 3
    assert stored["fit_files"][0]["rank_cpu"] == {"posts": 10}
    if accepted:
        written = load_profile(out)
        assert written.host_cores == 2 and written.oracle_core_bandwidth == pytest.approx(4e9)
        assert written.rank_dispatch == pytest.approx(200e-6)  # the measured ones
        assert written.rank_dispatch_unprepped == pytest.approx(600e-6)
        assert (written.peer_poll_idle, written.peer_poll_busy) == (1e-3, 1e-4)  # rank.py's
        assert written.coordinator_call == pytest.approx(50e-6)
        assert written.poll_cpu == pytest.approx(45e-6)  # the idle iterations' CPU only
        assert written.rank_thread_order == "loop-batches"
        assert "| poll_cpu_us | 45 |" in report
        assert result["refused"] is None and "accepted: profile written" in report
    else:
        assert "REFUSED: no profile written" in report
        assert "held-out median |error| 20 % (bound 15 %)" in result["refused"]
        assert f"{held_files[0].name} +20 %" in result["refused"]


def test_fit_and_held_out_sets_must_be_disjoint(tmp_path: Path) -> None:
    from hkvsim.validate import ValidationError
    from hkvsim.validate_fit import calibrate_host

    f = sorted((ROOT / "scenarios/validation").glob("*.toml"))[:1]
    with pytest.raises(ValidationError, match="both the FIT and the held-out set"):
        calibrate_host(f, f, profile_in=ROOT / "hkvsim/fabric/profiles/cpu-ucx-loopback.toml",
                       profile_out=None, report_dir=None, force=True)


@pytest.mark.timeout(300)  # a grid of simulated host-path runs: minutes on a loaded 2-core VM
def test_fit_recovers_the_constants_of_a_known_profile() -> None:
    """Real times made by the simulator itself with known constants: the fit finds them."""
    from hkvsim.scenario import load_scenarios
    from hkvsim.validate_fit import HostFit, _sim, fit_host

    files = sorted((ROOT / "scenarios/fit").glob("*.toml"))
    scen = [load_scenarios(f)[0] for f in files]
    truth = HostFit(2, 3.0, 400.0, 10.0, 300.0, 2.0, core_contention=0.25)
    real = [_sim(s, CPU_BASE, truth.overrides()) for s in scen]
    base = HostFit(2, 0.0, 0.0, 10.0, 0.0, 2.0)  # the constants not fitted: cores, oracle
    fit, sims = fit_host(scen, real, base=base,
                         grid=(2.0, 3.0, 5.0), notice_grid=(200.0, 400.0),
                         dispatch_grid=(150.0, 300.0), contention_grid=(0.0, 0.25, 0.5),
                         profile=CPU_BASE)
    assert (fit.core_gbps, fit.rank_dispatch_us, fit.completion_notice_us,
            fit.core_contention) == (3.0, 300.0, 400.0, 0.25)
    assert sims == pytest.approx(real, rel=1e-9)


def test_the_fit_does_not_trade_one_file_far_off_for_the_others_a_little_closer() -> None:
    """The fit's cost (RMS of log errors over the FIT files): a point 54 % off on one file and
    exact on eight loses to one 10 % off on all nine (a mean |log| prefers the first: the
    2026-12-04 calibration's fit did, and the held-out bound judges the worst file too)."""
    from hkvsim.validate_fit import fit_cost

    real = [1.0] * 9
    one_far = [1.54] + [1.0] * 8
    all_near = [1.1, 0.9] * 4 + [1.1]
    assert fit_cost(all_near, real) < fit_cost(one_far, real)
    assert fit_cost(real, real) == 0.0
    assert fit_cost([2.0], [1.0]) == pytest.approx(fit_cost([0.5], [1.0]))  # symmetric


def test_sweep_calibration_refuses_a_loaded_machine(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`hkvsim calibrate` (the sweep) checks the load before measuring anything."""
    import argparse
    import os

    import hkvsim.backends.calibrate as cal
    import hkvsim.transport.nixl as tn

    monkeypatch.setattr(tn, "load_nixl", lambda: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    monkeypatch.setattr(cal, "calibrate", lambda **kw: pytest.fail("measured on a loaded box"))
    args = argparse.Namespace(host=False, quick=False, force=False, profile_out=None,
                              report_dir=None, budget=1.0, json=False)
    assert cal.run_calibration_cli(args) == 2
    assert "load average 99.00 >" in capsys.readouterr().err


def test_rank_loop_batches_a_remote_progressing_just_as_the_post_returns_counts() -> None:
    # the boundary of the case above: the remote's median progress falls at the very instant the
    # post returns; it has progressed "during the post", so the same batch's poll sees it
    post = 50e-6 + load_profile(CPU).post_time(1) + 1e-3
    arrivals = [(0.0, "T1"), (5e-4, "W2")]
    ends = _thread_order("loop-batches", arrivals,
                         progress=lambda start, median=False: post if median else post + 9e-6)
    assert ends["T1"] == pytest.approx(post + 9e-6 + 100e-6, abs=1e-6)
    assert ends["W2"] == pytest.approx(ends["T1"] + 1e-3, abs=1e-6)
