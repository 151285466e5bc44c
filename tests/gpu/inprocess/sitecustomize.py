"""Put on ``PYTHONPATH`` of a GPU test's vLLM run: every Python process of
that run (API server, engine core, workers) installs the call probes of
``call_probes`` when ``VLLM_MLA_FIXES_GPU_CALL_LOG`` names a log file."""

import os

if os.environ.get("VLLM_MLA_FIXES_GPU_CALL_LOG"):
    import call_probes

    call_probes.install()
