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
