#!/usr/bin/env bash
# The DeepSeek-V4.1 self-test on an H200 (SM90), or on any machine: installs the
# locked vLLM 0.34.0 environment (envs/vllm-0.34.0.txt; reused from
# ~/.cache/vllm-mla-fixes/envs when it is already there), points DeepGEMM's JIT
# at the lock's CUDA toolkit, and runs `vllm-mla-fixes selftest --json`.
#
# On an H200 the writers, DeepGEMM's paged MQA logits and the indexer-K gather
# are the real kernels; FlashInfer's SM120 sparse-MLA kernel exists only on
# SM12x, so a PyTorch reader stands in for it (its rows say so).  Exit status 0 when the
# self-test passes; otherwise the report says what failed or why it could not run.
#
#   scripts/selftest-h200.sh            # report: gpu-results/selftest-0.34.0/selftest.json
set -euo pipefail
cd "$(dirname "$0")/.."
release="${VLLM_MLA_FIXES_SELFTEST_RELEASE:-0.34.0}"
export VLLM_MLA_FIXES_GPU_RESULTS="${VLLM_MLA_FIXES_GPU_RESULTS:-$PWD/gpu-results/selftest-$release}"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
command -v nox >/dev/null && command -v uv >/dev/null ||
    python3 -m pip install --quiet --disable-pip-version-check nox==2026.10.20 uv==0.13.9
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || echo "no nvidia-smi: CPU run"
start=$(date +%s)
status=0
nox -s "selftest-$release" || status=$?
echo "selftest-$release: $(( $(date +%s) - start )) s, exit $status; report: $VLLM_MLA_FIXES_GPU_RESULTS/selftest.json"
exit "$status"
