"""What a vLLM release does where it differs from the others, shared by the tests of tests/vllm."""

from __future__ import annotations


# vLLM 0.34.0's push handshake refuses engines whose kernel block size or kernel blocks per
# logical block differ (push_worker.py: "NixlPushConnector requires identical P/D block
# sizes"); earlier releases refused only a kernel block size ratio
PUSH_GEOMETRY_034 = "push_worker.py:149: NotImplementedError: NixlPushConnector requires " \
                    "identical P/D block sizes"


def block_geometry_differs(scenario) -> bool:
    """Kernel block or kernel blocks per logical block differ between the two sides (a
    hybrid's logical block follows its state page, which shrinks with TP)."""
    from hkvsim.fuzz_known import facts

    return facts(scenario).block_geometry_differs


def push_refused_by_034(scenario) -> bool:
    return scenario.connector.mode == "push" and block_geometry_differs(scenario)


def assert_push_refused_by_034(result, name: str) -> None:
    """0.34.0 refuses the push at prefill's handshake with decode, naming its check; every
    request fails as a handshake failure, no byte is moved or corrupted."""
    assert result.outcome == "handshake-error", (name, result.outcome)
    assert result.handshake_errors and all(PUSH_GEOMETRY_034 in e
                                           for e in result.handshake_errors), (
        name, result.handshake_errors)
    assert all(r.status == "failed" and r.failure_class == "handshake_failed"
               for r in result.records), name
    assert result.corrupted == 0 and result.leaks["after_shutdown"] == 0, name


ACCOUNTING = ("descriptors", "nbytes", "per_rank")


def moves_less_in_034(scenario) -> bool:
    """Where 0.34.0 moves fewer bytes than hkvsim's core, byte-exact alike: a hybrid whose last
    cache group holds fewer layers (0.34.0 moves no state for the slots no layer holds), or a
    hybrid pulled between engines of different block geometry (0.34.0 pairs the blocks by the
    request's last token and moves no kernel block past it)."""
    from hkvsim.geometry.layout import has_uneven_group

    model = scenario.model_spec()
    if not model.is_hybrid:
        return False
    return has_uneven_group(model) or (scenario.connector.mode == "pull"
                                       and block_geometry_differs(scenario))


def beyond_034_accounting(found: list, scenario, version: str) -> list:
    """``found`` (differences between hkvsim's core and vLLM) less those 0.34.0's smaller
    transfers explain: in the deployments of :func:`moves_less_in_034`, descriptor and byte
    counts that are lower under vLLM (never higher). Any other release: ``found`` unchanged."""
    if version != "0.34.0" or not moves_less_in_034(scenario):
        return found
    rest = []
    for d in found:
        if d.field not in ACCOUNTING:
            rest.append(d)
        elif d.field != "per_rank":
            assert d.vllm < d.hkvsim, str(d)  # fewer, never more
    return rest
