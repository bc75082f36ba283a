"""vLLM's own NIXL connector on hkvsim (docs/vllm.md). ``agent`` needs no vLLM; the engine
adapter imports vLLM (provision it with ``scripts/with-vllm VERSION COMMAND...``)."""
