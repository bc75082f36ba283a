"""docs/semantics.md §10 "Descriptors per request (pull)": KimiLinear, one 8,192-token request, through the
whole cluster (scenario -> handshake -> pull). Counts and bytes written out from the table.

Byte derivations (§2.3 sizes): attention descriptor = one MLA kernel page = 73,728 B; a state
"slot" = 21 (3 KDA groups broadcast over 7 regions) x (3 conv runs + 1 recurrent) = 84
descriptors moving 21 mamba pages of 2,170,880/t B (t = the reader's TP: its local sub-regions,
or the chunk of them a split list lands).
"""

from __future__ import annotations

import pytest

from hkvsim.connector import worker as worker_mod
from hkvsim.transport import sim as sim_mod

from ._helpers import run, scenario_text

MLA_PAGE = 73_728


def _kimi(p_tp, d_tp, *, verify):
    result = run(scenario_text(model="kimi-linear-48b", p_tp=p_tp, d_tp=d_tp, p_block=64,
                               d_block=64, requests=1, prompt_tokens="8192", verify=verify))
    assert result.outcome == "ok", (result.handshake_errors, result.records[0].reason)
    (rec,) = result.records
    assert rec.status == "ok"
    assert {"prefill_blocks", "decode_blocks", "open_handles", "after_shutdown"} <= set(result.leaks)
    assert not any(result.leaks.values()), result.leaks
    return rec


@pytest.fixture
def reads(monkeypatch):
    """(prefill rank, descriptors, bytes, notification count) of every posted READ."""
    seen: list[tuple[int, int, int, int]] = []
    original = sim_mod.SimTransport.make_prepped_xfer

    def spy(self, op, local_dlist, local_ids, remote_dlist, remote_ids, notif=b""):
        handle = original(self, op, local_dlist, local_ids, remote_dlist, remote_ids, notif)
        x = self._xfers[handle]
        # keep only the count n of "{P_request_id}:{n}" (the id format belongs to the cluster)
        count = int(x.notif.decode().rpartition(":")[2])
        # the remote agent is named "<engine>.<rank>" by the cluster: keep the prefill rank
        rank = int(x.remote.agent.rpartition(".")[2])
        seen.append((rank, int(x.local_ids.size), x.nbytes, count))
        return handle

    monkeypatch.setattr(sim_mod.SimTransport, "make_prepped_xfer", spy)
    return seen


def test_tp1_to_tp1_1134_descriptors(reads):
    # | TP1 -> TP1 | 1 READ | 7 x 150 = 1,050 | 3 x 7 x 4 = 84 | 1,134 | 77.4 MB + 45.6 MB |
    rec = _kimi(1, 1, verify=True)
    # §8.1: one READ, notification "{P_request_id}:{n}" with n = max(1, D_TP/P_TP) = 1
    assert reads == [(0, 1_134, 123_002_880, 1)]
    assert rec.transfers == 1
    assert rec.descriptors == 1_050 + 84 == 1_134
    # attention: 1,050 x 73,728 = 77,414,400 B (77.4 MB)
    # state: 21 x 2,170,880 = 45,588,480 B (45.6 MB)
    attention, state = 1_050 * MLA_PAGE, 21 * 2_170_880
    assert (round(attention / 1e6, 1), round(state / 1e6, 1)) == (77.4, 45.6)
    assert rec.nbytes == attention + state == 123_002_880
    assert rec.mismatched_words == 0, rec.mismatches


@pytest.fixture
def per_rank(monkeypatch):
    """(decode rank, descriptors, bytes, transfers) of every finished per-rank outcome."""
    seen: list[tuple[int, int, int, int]] = []
    original = worker_mod.ConnectorWorker._finish

    def spy(self, rid):
        out = original(self, rid)
        seen.append((self.tp_rank, out.descriptors, out.nbytes, out.transfers))
        return out

    monkeypatch.setattr(worker_mod.ConnectorWorker, "_finish", spy)
    return seen


def test_tp8_to_tp8_980_per_rank(per_rank, reads):
    # | TP8 -> TP8 | 1/rank | 896 | 84 | 980 | 66.1 + 5.7 MB |
    rec = _kimi(8, 8, verify=False)
    # D rank i reads P rank i only; 1 notification each
    assert sorted((a, n) for a, _, _, n in reads) == [(i, 1) for i in range(8)]
    assert rec.transfers == 8
    assert rec.descriptors == 8 * 980
    # per rank: 896 x 73,728 = 66,060,288 B (66.1 MB); 21 x 271,360 = 5,698,560 B (5.7 MB)
    attention, state = 896 * MLA_PAGE, 21 * 271_360
    assert (round(attention / 1e6, 1), round(state / 1e6, 1)) == (66.1, 5.7)
    assert rec.nbytes == 8 * (attention + state)
    assert sorted(per_rank) == [(r, 980, attention + state, 1) for r in range(8)]


def test_p1_to_d4_980_per_d_rank(per_rank, reads):
    # | P1 -> D4 | 1/D rank | 896 | 84 (1/4 size) | 980 | 66.1 + 11.4 MB; P egress x4 |
    rec = _kimi(1, 4, verify=False)
    # §8.1 "D_TP >= P_TP: 1 P rank per D rank; notifications per P rank D_TP/P_TP" = 4:
    # every D rank reads P0 and tells it to expect 4
    assert [(a, n) for a, _, _, n in reads] == [(0, 4)] * 4
    assert rec.transfers == 4
    assert rec.descriptors == 4 * 980
    # per D rank: 896 x 73,728 = 66,060,288 B; 21 x 542,720 = 11,397,120 B (11.4 MB)
    attention, state = 896 * MLA_PAGE, 21 * 542_720
    assert (round(attention / 1e6, 1), round(state / 1e6, 1)) == (66.1, 11.4)
    assert rec.nbytes == 4 * (attention + state)
    assert sorted(per_rank) == [(r, 980, attention + state, 1) for r in range(4)]


@pytest.mark.parametrize("verify", [False, True])
def test_p2_to_d1_1113_total(verify, reads):
    # | P2 -> D1 | 2 READs | 945 (P0) | 84 each | 1,113 | P0 69.7 + 22.8; P1 22.8 MB |
    rec = _kimi(2, 1, verify=verify)
    assert rec.transfers == 2
    assert rec.descriptors == 945 + 84 + 84 == 1_113
    # P0: 945 x 73,728 = 69,672,960 B (69.7 MB) + 21 x 1,085,440 = 22,794,240 B (22.8 MB);
    # P1: 22,794,240 B (22.8 MB)
    attention, state_half = 945 * MLA_PAGE, 21 * 1_085_440
    assert (round(attention / 1e6, 1), round(state_half / 1e6, 1)) == (69.7, 22.8)
    assert rec.nbytes == attention + 2 * state_half
    # P_TP > D_TP, hybrid MLA+SSM: attention + SSM from the attention source (P0), SSM only
    # from P1; 1 notification per P rank
    assert sorted(reads) == [(0, 945 + 84, attention + state_half, 1),
                             (1, 84, state_half, 1)]
    assert rec.mismatched_words == 0, rec.mismatches
