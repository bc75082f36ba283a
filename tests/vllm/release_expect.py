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


# Releases that share a behaviour where the releases part ways (docs/vllm.md). 0.27.0, the first
# release after #49762 on PyPI, keeps 0.26.0's push failure handling and 0.33.0's prefix-hit
# shift, and its MLA pull with a block size ratio is byte-exact.
# a push WRITE that ends in ERR, or whose post or check raises, is never reported failed:
# decode's watchdog calls it a stall and the next poll on that prefill rank asserts ("not found
# in recving_metadata")
PUSH_FAILURE_UNREPORTED = frozenset({"0.26.0", "0.27.0"})
# a failed READ of a hybrid counts as loaded (finding-hybrid-failed-transfer.toml)
HYBRID_FAILED_READ_LOADED = frozenset({"0.26.0", "0.27.0", "0.33.0", "0.34.0"})
# MLA with a block size ratio, a half-covered last decode block: "latent" (the received tokens'
# latent vector cut and the tail stale), "tail" (the untransferred tail left stale), None
# (byte-exact)
MLA_BSR_DAMAGE = {"0.34.0": "latent", "0.33.0": "latent", "0.27.0": None, "0.26.0": "tail"}
