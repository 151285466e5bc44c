"""CPU correctness harness for DeepSeek-V4.1 KV page geometry on SM120.

The harness drives the real vLLM code of the installed release (spec classes,
KV cache grouping and allocation, block tables, metadata builders, the Triton
cache writers and index builders, under ``TRITON_INTERPRET=1``) and checks the
result with this package's own PyTorch code:

* :mod:`.reference` decodes attention by reading the paged caches the way
  FlashInfer's SM120 sparse-MLA kernel addresses them, and computes the same
  attention densely from the un-paged latents;
* :mod:`.sentinel` proves that every write lands in its layer's own pages.

:func:`.run.run_harness` runs one geometry and returns its figures; the
geometries are described in :mod:`.geometry`.  Importing this package sets
``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=""`` unless the caller set
them, so import it before anything imports vLLM or Triton.
"""

from .env import prepare_process_env

prepare_process_env()
