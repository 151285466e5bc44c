"""The parts of the GPU regression tests (``tests/gpu``) a CPU can run, run
against the real releases, so that each GPU test is shown -- by construction
-- to reach the bug and to be able to fail.

* FA4 (vLLM 0.25.1): vLLM's own scheduler and FA4's own Split-KV decision
  put every second chunk of ``fa4_llm_case.py``'s prompts on Split-KV with a
  ``total_q`` warm-up never compiled; the old plan (16 prompts per step)
  never reached Split-KV.  The GPU tests' call probe records each of those
  decisions exactly, on FA4's real interface.
* The fa4 fixture's probe: a child that prints no ``BUG=`` line -- here the
  real probe on a machine where FA4 cannot import -- fails the fixture with
  the child's stderr.
* The call probe loads in vLLM's processes through ``sitecustomize`` (FA4's
  interface beside the FA4 fix).  The DeepSeek-V4.1 test's parts are in
  ``tests/dsv41_sm120_geometry/test_gpu_cases_dsv41_on_cpu.py``.
* Declared GPU: with ``VLLM_MLA_FIXES_EXPECT_GPU_CC`` a "no GPU" skip fails,
  a session with no passed test fails, and the preflight fails on a machine
  without the GPU; without the variable all of it stays a skip.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from fix_releases import covered_by
from gpu_case_helpers import GPU_TESTS, assert_built, cpu_env, read_serve_lines

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# ------------------------------------------------------------------- FA4


def _fa4_step_plan(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(GPU_TESTS / "fa4_step_plan.py"), *args],
        env=cpu_env(VLLM_PLUGINS=""),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fa4_plan():
    return _fa4_step_plan()


@pytest.mark.vllm_release("0.25.1")
def test_fa4_case_puts_every_second_chunk_on_split_kv_with_a_new_total_q(fa4_plan):
    from gpu import fa4_llm_case

    long_prompts = [n for n in fa4_llm_case.PROMPT_LENS if n > 8192]
    chunks = fa4_plan["chunks"]
    assert fa4_plan["warmup_q"] == [1, 129]
    # one context chunk per long prompt, alone in its step: its own tail
    assert [c["q_lens"] for c in chunks] == [[n - 8192] for n in long_prompts]
    assert all(c["ctx_lens"] == [8192] for c in chunks)
    for chunk in chunks:
        assert chunk["num_splits"] > 1, chunk
        assert chunk["total_q"] not in fa4_plan["warmup_q"], chunk
    print({c["total_q"]: c["num_splits"] for c in chunks})


@pytest.mark.vllm_release("0.25.1")
def test_fa4_call_probe_records_fa4s_own_split_decisions(fa4_plan):
    """The GPU tests judge a run by the probe's records: they must be FA4's decisions."""
    probed = [(r["total_q"], r["num_splits"]) for r in fa4_plan["probe"]]
    assert probed == [(c["total_q"], c["num_splits"]) for c in fa4_plan["chunks"]]


@pytest.mark.vllm_release("0.25.1")
def test_fa4_old_case_never_reached_split_kv():
    """Issue 10's finding: 16 prompts per step leave no context chunk on Split-KV."""
    plan = _fa4_step_plan("--max-num-seqs", "16")
    assert plan["chunks"] and all(c["num_splits"] == 1 for c in plan["chunks"]), plan["chunks"]


def test_new_split_kv_calls_needs_split_and_a_total_q_warmup_did_not_compile():
    from gpu.inprocess.call_probes import new_split_kv_calls

    warm = [
        {"probe": "fa4", "compile_only": True, "total_q": q, "num_splits": 0 if q == 1 else 16}
        for q in (1, 129)
    ]
    real = [
        {"probe": "fa4", "compile_only": False, "total_q": q, "num_splits": s}
        for q, s in ((129, 16), (308, 8), (8192, 1), (1, 16))
    ]
    assert [r["total_q"] for r in new_split_kv_calls(warm + real)] == [308, 1]


@pytest.mark.vllm_release("0.25.1")
def test_fa4_probe_without_a_verdict_fails_the_fixture():
    """On CPU the fix's real probe cannot import FA4: the child prints no BUG= line."""
    from gpu.test_fa4_compile_strides_gpu import PROBE_CODE, probe_verdict

    proc = subprocess.run(
        [sys.executable, "-c", PROBE_CODE],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "BUG=" not in proc.stdout
    with pytest.raises(pytest.fail.Exception) as failure:
        probe_verdict(proc.returncode, proc.stdout, proc.stderr)
    message = str(failure.value)
    assert "printed no BUG= line" in message and "vllm.vllm_flash_attn" in message, message
    assert probe_verdict(0, "BUG=True\n", "") is True
    assert probe_verdict(0, "BUG=False\n", "") is False


_FA4_THROUGH_SITECUSTOMIZE = """
import json
from vllm_mla_fixes.reproductions import fa4_compile_strides as repro, fa4_on_cpu
env = fa4_on_cpu.prepare()                 # imports FA4's interface: the probe wraps it
forward = env.interface._flash_attn_fwd
wrapped = hasattr(forward, "__wrapped__")
fix = repro.apply_fix(env)                 # replaces the compile cache on the wrapper
decision = fa4_on_cpu.plan(env, fa4_on_cpu.Step((300,), (8192,)))
looked_up = fa4_on_cpu.forward_cache(env).looked_up
print(json.dumps({"wrapped": wrapped, "fix": fix, "splits": decision.num_splits,
                  "key_looked_up_in_fixed_cache": decision.key is not None and bool(looked_up)}))
"""


@pytest.mark.vllm_release("0.25.1")
def test_fa4_call_probe_loads_through_sitecustomize_beside_the_fix(tmp_path):
    """The GPU runs' way in: PYTHONPATH=tests/gpu/inprocess; the fix still takes effect."""
    from gpu.inprocess.call_probes import LOG_ENV, read_log

    log = tmp_path / "calls.jsonl"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _FA4_THROUGH_SITECUSTOMIZE],
        env=cpu_env(
            VLLM_PLUGINS="", PYTHONPATH=str(GPU_TESTS / "inprocess"), **{LOG_ENV: str(log)}
        ),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == {
        "wrapped": True,
        "fix": "applied",
        "splits": 8,
        "key_looked_up_in_fixed_cache": True,
    }, seen
    fa4 = [r for r in read_log(log) if r.get("probe") == "fa4"]
    assert [(r["total_q"], r["num_splits"], r["compile_only"]) for r in fa4] == [(300, 8, True)]


# ------------------------------------------------------------ call probe


def test_relative_error_of_two_zero_outputs_is_zero():
    import torch
    from gpu.inprocess.call_probes import relative_error

    zeros = torch.zeros(4, 8)
    assert relative_error(zeros, zeros) == 0.0
    assert relative_error(torch.ones(4, 8), zeros) == float("inf")
    assert relative_error(torch.full((4, 8), float("nan")), torch.ones(4, 8)) == float("inf")


# ---------------------------------------------------------- declared GPU


def test_declared_gpu_turns_skip_into_failure_only_for_the_declared_gpu():
    from gpu.conftest import skip_is_failure

    no_gpu = "needs a CUDA GPU with compute capability 12.x: the 64-row page geometry ..."
    assert skip_is_failure(no_gpu, 12) and not skip_is_failure(no_gpu, None)
    assert not skip_is_failure("this GPU is SM120; needs SM10x: FA4 ...", 12)
    assert skip_is_failure("this GPU is SM90; needs SM12x: ...", 12)
    assert not skip_is_failure("this GPU is SM100; needs SM9x/SM10x: ...", 10)
    assert not skip_is_failure("needs vLLM >=0.25.0,<0.26.0, found 0.32.0", 12)


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=cpu_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_gpu_tests_on_a_machine_without_the_declared_gpu():
    """No GPU here: the GPU tests skip; declared, the same skips fail the session.
    The vllm#56771 replay is a strict xfail: its skip must fail there all the same."""
    candidates = [  # a retired fix's GPU test goes with it
        TESTS / "fp8_ds_mla_reshape" / "gpu" / "test_fp8_ds_mla_reshape_gpu.py",
        TESTS / "dsv41_sm120_geometry" / "gpu" / "test_dspark_long_prompt_gpu.py",
    ]
    targets = [str(path) for path in candidates if path.is_file()]
    collected = _pytest("--collect-only", *targets).stdout
    count = sum(1 for line in collected.splitlines() if "::" in line)
    plain = _pytest(*targets)
    assert plain.returncode == 0 and f"{count} skipped" in plain.stdout, plain.stdout[-3000:]
    declared = _pytest(*targets, VLLM_MLA_FIXES_EXPECT_GPU_CC="9")
    assert declared.returncode == 1, declared.stdout[-3000:]
    # the fixtures skipped ("1 error", "4 errors")
    assert re.search(rf"\b{count} errors?\b", declared.stdout), declared.stdout[-3000:]
    assert (
        "VLLM_MLA_FIXES_EXPECT_GPU_CC=9 declares an SM9x GPU on this runner, but the test "
        "skipped: needs a CUDA GPU" in declared.stdout
    ), declared.stdout[-3000:]


def test_declared_gpu_session_with_no_passed_test_fails(tmp_path):
    (tmp_path / "conftest.py").write_text(
        textwrap.dedent(f"""\
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from gpu.conftest import pytest_runtest_makereport, pytest_sessionfinish  # noqa: F401
        """)
    )
    (tmp_path / "test_other_release.py").write_text(
        textwrap.dedent("""\
        import pytest

        def test_for_another_release():
            pytest.skip("needs vLLM >=0.32.0,<0.35.0, found 0.25.1")
        """)
    )
    plain = _pytest(str(tmp_path), "--rootdir", str(tmp_path))
    assert plain.returncode == 0, plain.stdout[-3000:]
    declared = _pytest(str(tmp_path), "--rootdir", str(tmp_path), VLLM_MLA_FIXES_EXPECT_GPU_CC="12")
    assert declared.returncode == 1, declared.stdout[-3000:]
    assert "1 skipped" in declared.stdout and "no GPU test passed" in declared.stdout


def test_preflight_fails_only_where_a_gpu_is_declared():
    script = str(GPU_TESTS / "preflight.py")
    plain = subprocess.run(
        [sys.executable, script], env=cpu_env(), capture_output=True, text=True, timeout=300
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    declared = subprocess.run(
        [sys.executable, script],
        env=cpu_env(VLLM_MLA_FIXES_EXPECT_GPU_CC="12"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert declared.returncode == 1, declared.stdout + declared.stderr
    assert "torch.cuda.is_available() is False" in declared.stderr


def test_cuda_toolkit_env_points_at_the_locked_nvcc(tmp_path):
    """The gpu nox sessions' CUDA_HOME: the lock's nvidia/cu13 wheels, with nvcc and cudart."""
    sys.path.insert(0, str(GPU_TESTS))
    try:
        import cuda_toolkit
    finally:
        sys.path.remove(str(GPU_TESTS))
    if cuda_toolkit.locked_toolkit() is None:
        pytest.skip("this release's lock has no nvidia/cu13 toolkit wheels")
    env = cuda_toolkit.toolkit_env(tmp_path / "links")
    home = Path(env["CUDA_HOME"])
    version = subprocess.run(
        [str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True, timeout=120
    )
    assert version.returncode == 0 and "release 13." in version.stdout, (
        version.stdout + version.stderr
    )
    assert (home / "include" / "cuda_runtime.h").exists()
    assert (tmp_path / "links" / "libcudart.so").resolve().exists()
    assert f"-L{tmp_path / 'links'}" in env["FLASHINFER_EXTRA_LDFLAGS"]


# ------------------------------------------------------ processes, memory


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (re)parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


_SPAWN_GRANDCHILD = (
    "import subprocess, sys, time; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(p.pid, flush=True); time.sleep({hang})"
)


@pytest.mark.vllm_release("0.34.0")  # no vLLM involved: one session is enough (about 5 s)
def test_timeout_stops_the_whole_process_group():
    """A hung GPU case (its EngineCore a grandchild) leaves nothing behind."""
    from gpu.serving import run_in_own_session

    code = _SPAWN_GRANDCHILD.format(hang=600)
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run_in_own_session([sys.executable, "-c", code], cpu_env(), timeout=3)
    grandchild = int(timed_out.value.output.split()[0])
    assert not _running(grandchild)


@pytest.mark.vllm_release("0.34.0")
def test_exited_leader_leaves_no_orphan_in_its_group():
    from gpu.serving import run_in_own_session

    code = _SPAWN_GRANDCHILD.format(hang=0)
    done = run_in_own_session([sys.executable, "-c", code], cpu_env(), timeout=60)
    assert done.returncode == 0, done.stderr
    assert not _running(int(done.stdout.split()[0]))


def test_too_little_free_gpu_memory_names_the_holders():
    from gpu.serving import memory_problem, parse_gpu_memory

    busy = parse_gpu_memory("20480, 143771\n", "4242, python3, 120000\n")
    assert busy == {"free_gib": 20.0, "total_gib": 140.4, "holders": ["4242, python3, 120000"]}
    problem = memory_problem(busy, 0.5)
    assert problem is not None
    assert "only 20.0 GiB of GPU memory free of 140.4 GiB" in problem
    assert "4242, python3, 120000" in problem and "kill <pid>" in problem
    assert memory_problem(parse_gpu_memory("143000, 143771", ""), 0.5) is None
    assert memory_problem(None, 0.5) is None  # no nvidia-smi: nothing to check


def test_gpu_session_without_a_gpu_or_a_declaration_refuses_to_run():
    """``preflight.py --declared`` is what the gpu-<release> nox sessions run first."""
    script = str(GPU_TESTS / "preflight.py")
    refused = subprocess.run(
        [sys.executable, script, "--declared"],
        env=cpu_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "refusing to run the GPU tests" in refused.stderr
    declared = subprocess.run(
        [sys.executable, script, "--declared"],
        env=cpu_env(VLLM_MLA_FIXES_EXPECT_GPU_CC="12"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert declared.returncode == 0 and declared.stdout.strip() == "12", declared.stderr


# ----------------------------------------------------------- serve lines


@pytest.fixture(scope="module")
def serve_lines():
    return read_serve_lines()


@pytest.mark.vllm_release(*covered_by("fa4-compile-strides"))
def test_fa4_gpu_lines_parse_and_build_with_the_releases_own_parser(serve_lines):
    serve, bench, llm = serve_lines["serve"], serve_lines["bench"], serve_lines["llm"]
    for name in ("fa4 bench serve", "fa4 report's line"):
        assert_built(serve[name])
        assert serve[name]["max_model_len"] == 10240
    assert serve["fa4 bench serve"]["mla_prefill_backend"].endswith("FLASH_ATTN")
    # The report's line leaves the prefill backend to vLLM (FLASH_ATTN first on SM100).
    assert serve["fa4 report's line"]["mla_prefill_backend"] is None
    assert bench["fa4 report's bench"] == {
        "dataset_name": "random",
        "random_input_len": 8192,
        "random_output_len": 1024,
        "num_prompts": 160,
        "max_concurrency": 16,
    }
    assert llm["fa4 case"]["max_num_seqs"] == 1
    assert llm["fa4 case"]["mla_prefill_backend"].endswith("FLASH_ATTN")
    assert llm["fa4 case TRTLLM_RAGGED"]["mla_prefill_backend"].endswith("TRTLLM_RAGGED")
    assert llm["fa4 case warm-up off"]["enable_cutedsl_warmup"] is False
