"""DeepSeek-V4.1 KV page geometry self-test (``vllm-mla-fixes selftest``).

Builds a tiny DeepSeek-V4.1 KV layout with the installed vLLM's own planner,
allocation, binding and metadata builders, writes random latents through the
writers vLLM uses, reads them back through the readers, and compares every
read with a dense PyTorch reference while a sentinel fill accounts for every
byte.  The tests, ``verify`` and ``selftest`` all run this one implementation.

Import :mod:`.env` and call :func:`.env.prepare_cpu_process_env` before vLLM
is imported when running on a machine without a GPU.
"""
