#!/usr/bin/env bash
# The DeepSeek-V4.1 self-test on an operator's own H100 or H200 (SM90) with network access.
#
# It installs what it runs, pinned, so it needs the package index (PyPI, or the index
# that UV_DEFAULT_INDEX, UV_INDEX_URL or PIP_INDEX_URL names) and Python 3.11
# (python3.11 on PATH: the locked environments are resolved for it).  It checks
# both before it installs anything and stops with one line on stderr (exit 2)
# when either is missing.  Then:
#
# 1. nox (pinned below) and uv (the version the release's lock pins) go into a
#    virtual environment of their own, ~/.cache/vllm-mla-fixes/selftest-tools;
# 2. `nox -s selftest-<release>` syncs the release's environment to exactly its
#    lock, envs/vllm-<release>.txt (reused from ~/.cache/vllm-mla-fixes/envs
#    when it is already there), points DeepGEMM's JIT at the lock's CUDA
#    toolkit, and runs `vllm-mla-fixes selftest --json`.
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
lock="envs/vllm-$release.txt"
nox_pin="nox==2026.10.20"
say() { echo "selftest-h200.sh: $*" >&2; }

# Python first: it is what probes the index.
command -v python3.11 >/dev/null ||
    { say "python3.11 is not on PATH: the environments in envs/ are locked for Python 3.11; install it and rerun"; exit 2; }

[[ -f $lock ]] || { say "no lock $lock: VLLM_MLA_FIXES_SELFTEST_RELEASE names a release without one"; exit 2; }
uv_pin="$(grep -m1 '^uv==' "$lock")" || { say "$lock pins no uv"; exit 2; }
index="${UV_DEFAULT_INDEX:-${UV_INDEX_URL:-${PIP_INDEX_URL:-https://pypi.org/simple}}}"
python3.11 - "${index%/}/uv/" <<'EOF' || exit 2
import sys
import urllib.error
import urllib.request

url = sys.argv[1]
try:
    urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15)
except urllib.error.HTTPError as exc:  # something answered, but not an index that has uv
    problem = f"it answered HTTP {exc.code}"
except (OSError, ValueError) as exc:
    problem = str(getattr(exc, "reason", exc))
else:
    sys.exit(0)
sys.exit(
    f"selftest-h200.sh: the package index {url} cannot be reached ({problem}): this script "
    "installs the pinned environment and needs the network; run it where the index is reachable"
)
EOF

tools="$HOME/.cache/vllm-mla-fixes/selftest-tools"
[[ -x $tools/bin/python ]] || python3.11 -m venv "$tools"
"$tools/bin/python" -m pip install --quiet --disable-pip-version-check "$nox_pin" "$uv_pin"
export PATH="$tools/bin:$PATH"
export VLLM_MLA_FIXES_GPU_RESULTS="${VLLM_MLA_FIXES_GPU_RESULTS:-$PWD/gpu-results/selftest-$release}"
export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || echo "no nvidia-smi: CPU run"
start=$(date +%s)
status=0
nox -s "selftest-$release" || status=$?
echo "selftest-$release: $(( $(date +%s) - start )) s, exit $status; report: $VLLM_MLA_FIXES_GPU_RESULTS/selftest.json"
exit "$status"
