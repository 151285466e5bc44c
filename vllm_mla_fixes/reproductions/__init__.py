"""Reproductions of the upstream failures on the installed vLLM, on CPU.

Shared by ``vllm-mla-fixes verify`` and the tests: each drives vLLM's own
functions along the failing path with CPU tensors.
"""
