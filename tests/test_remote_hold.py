"""pd/cpu.py's remote-hold analysis: which transfers of a real run waited for their remote rank
to call into NIXL (with NIXL's progress thread off a notified transfer cannot complete while its
remote runs a long operation: measured on UCX cma and cuda_ipc, reports/gpu/README.md)."""

from __future__ import annotations

import pytest

from hkvsim.pd.cpu import LONG_OP_SECONDS, LONG_OPS_KEPT, LongOps, remote_hold_warnings


def _ops(*spans: tuple[str, float, float]) -> dict:
    kept = LongOps()
    for name, start, end in spans:
        kept.add(name, start, end)
    return kept.to_wire()


def _t(peer: str | None, submitted: float, completed: float | None) -> dict:
    return {"peer": peer, "submitted": submitted, "completed": completed}


def test_a_transfer_that_outlasts_its_remotes_operation_is_counted_by_the_overlap() -> None:
    ops = {"prefill0.0": _ops(("OracleWrite", 0.10, 0.30))}
    (text,) = remote_hold_warnings([_t("prefill0.0", 0.15, 0.31)], ops)
    assert text.startswith("1 of 1 transfers were in progress while their remote rank ran "
                           "OracleWrite for 0.05 s or more")
    assert "(up to 0.150 s of a transfer, 0.150 s in all)" in text
    assert "--progress-thread" in text
    # a transfer posted before the operation began waited from its start
    (text,) = remote_hold_warnings([_t("prefill0.0", 0.0, 0.5)], ops)
    assert "(up to 0.200 s of a transfer, 0.200 s in all)" in text


def test_a_transfer_that_completed_during_the_remote_operation_did_not_wait() -> None:
    ops = {"prefill0.0": _ops(("Verify", 0.10, 0.30))}
    assert remote_hold_warnings([_t("prefill0.0", 0.05, 0.29)], ops) == []
    # nor one that ended before the operation began, or was posted after it ended
    assert remote_hold_warnings([_t("prefill0.0", 0.0, 0.10), _t("prefill0.0", 0.30, 0.9)],
                                ops) == []


def test_only_the_transfers_own_peer_and_long_enough_overlaps_count() -> None:
    ops = {"prefill0.0": _ops(("OracleWrite", 0.10, 0.30)),
           "prefill0.1": _ops(("Verify", 0.0, 1.0))}
    # the peer's operation overlaps by 40 ms only: below the 50 ms threshold
    assert remote_hold_warnings([_t("prefill0.0", 0.26, 0.5)], ops) == []
    # another rank's operation never holds this transfer
    assert remote_hold_warnings([_t("prefill0.2", 0.0, 2.0)], ops) == []
    assert remote_hold_warnings([_t("prefill0.0", 0.26, 0.5)], ops, threshold=0.03) != []


def test_several_operations_of_one_peer_add_up_and_the_names_are_listed() -> None:
    ops = {"decode0.0": _ops(("Verify", 0.6, 0.9), ("OracleWrite", 0.1, 0.3),
                             ("Verify", 0.5, 0.505))}  # out of order: sorted by start
    texts = remote_hold_warnings([_t("decode0.0", 0.05, 0.95), _t("decode0.0", 0.31, 0.4),
                                  _t(None, 0.0, 1.0), _t("decode0.0", 0.0, None)], ops)
    (text,) = texts
    # transfers without a peer or a completion are not counted at all
    assert text.startswith("1 of 2 transfers were in progress while their remote rank ran "
                           "OracleWrite, Verify for")
    assert "(up to 0.500 s of a transfer, 0.500 s in all)" in text


def test_long_ops_keeps_only_long_operations_and_counts_past_its_cap() -> None:
    kept = LongOps()
    kept.add("StartRead", 1.0, 1.0 + LONG_OP_SECONDS / 2)
    kept.add("Verify", 0.0, LONG_OP_SECONDS)  # exactly the threshold: kept
    assert kept.to_wire() == {"ops": [["Verify", 0.0, LONG_OP_SECONDS]], "dropped": 0}
    for k in range(LONG_OPS_KEPT + 3):
        kept.add("Verify", 3.0 + k, 3.5 + k)
    wire = kept.to_wire()
    assert len(wire["ops"]) == LONG_OPS_KEPT and wire["dropped"] == 4


@pytest.mark.parametrize("threshold", [0.0625, 0.25])  # exact in binary
def test_the_threshold_is_inclusive(threshold: float) -> None:
    ops = {"p.0": _ops(("Verify", 1.0, 1.0 + threshold))}
    assert remote_hold_warnings([_t("p.0", 0.5, 1.0 + threshold)], ops,
                                threshold=threshold) != []


@pytest.mark.parametrize("progress_thread", [False, True])
def test_a_real_run_asks_only_with_the_progress_thread_off(progress_thread: bool) -> None:
    """With the thread on, a transfer that outlasts a remote operation ran long on the wire,
    not for want of the remote's progress: the driver does not ask."""
    from types import SimpleNamespace

    from hkvsim.drivers.nixl import NixlDriver

    driver = SimpleNamespace(
        options=SimpleNamespace(progress_thread=progress_thread),
        coord=SimpleNamespace(records=[SimpleNamespace(telemetry=[_t("prefill0.0", 0.0, 1.0)]),
                                       SimpleNamespace(telemetry=[])]))
    stats = [{"agent": "prefill0.0", "long_ops": _ops(("OracleWrite", 0.2, 0.8))},
             {"open_handles": 0}]  # a rank that did not say (an older rank process)
    found = NixlDriver._remote_hold_warnings(driver, stats)
    assert (found == []) if progress_thread else (len(found) == 1 and "0.600 s" in found[0])


def test_operations_a_rank_could_not_keep_are_owned_up_to() -> None:
    full = _ops(("Verify", 0.1, 0.3))
    full["dropped"] = 5
    assert remote_hold_warnings([_t("p.0", 0.0, 0.05)], {"p.0": full}) == [
        f"5 long rank operations past the first {LONG_OPS_KEPT} of a rank were not kept: "
        f"transfers they held are not counted"]
    assert len(remote_hold_warnings([_t("p.0", 0.0, 0.5)], {"p.0": full})) == 2
