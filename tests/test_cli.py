"""The command line as a user runs it: `python -m mlxserve`, and what `serve` warns about at start."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mlxserve(*args, **env):
    return subprocess.run([sys.executable, "-m", "mlxserve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})


def test_python_dash_m_runs_the_cli():
    out = mlxserve("shapes")
    assert out.returncode == 0, out.stderr
    assert "qwen3-tiny" in out.stdout


def test_serve_warns_when_mlx_runs_on_the_reference_blas():
    """Without OpenBLAS (here: told not to load it), `serve` says so and how to fix it, then goes
    on (this model does not exist: it exits 2 after the warning)."""
    from mlxserve._blas import _find_openblas

    out = mlxserve("serve", "/no/such/model", MLXSERVE_NO_OPENBLAS="1")
    assert out.returncode == 2, out.stderr
    warning = next(line for line in out.stderr.splitlines() if line.startswith("warning:"))
    assert "reference BLAS" in warning and "libopenblas0-pthread" in warning
    if sys.platform.startswith("linux") and _find_openblas():  # loaded: no warning
        out = mlxserve("serve", "/no/such/model")
        assert out.returncode == 2 and "reference BLAS" not in out.stderr


def test_a_script_using_llm_exits_cleanly_without_closing_it():
    """The README's Python example as a script: an LLM left open, then the interpreter's exit.
    MLX leaves each thread's streams to that thread; without mlxserve releasing them the process
    aborted at exit (134, "terminate called without an active exception"), every run here."""
    script = ("from mlxserve import LLM, SamplingParams\n"
              "llm = LLM('qwen3-tiny', load_format='dummy')\n"
              "out = llm.generate(['hello'], SamplingParams(max_tokens=3, temperature=0))\n"
              "print(len(out[0].token_ids))\n")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "3", (out.returncode, out.stderr[-500:])


def test_serve_help_shows_each_settings_default():
    out = mlxserve("serve", "--help")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    assert "Port to listen on. (default: 8000)" in text
    assert "Most sequences decoded together in one batch. (default: 64)" in text
    assert "chain-hashed blocks). (default: on)" in text


def test_bench_exact_finds_no_token_changed_by_a_batch_or_the_cache_here(tmp_path):
    """`bench exact` on this CPU (float32, the tests' backend): batches and cache hits leave every
    greedy token as it was; its report is written."""
    import json

    out = mlxserve("bench", "exact", "--models", "dummy:qwen3-tiny", "--prompts", "3", "--output-len", "12",
                   "--out-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    (result,) = json.loads(next(tmp_path.glob("exact-*.json")).read_text())["results"]
    assert result["hit_tokens"] > 0  # turn 2 did come from the cache
    assert result["rows"] == {"alone, twice": [], "alone vs a batch of 3": [], "turn 1, prefix cache on vs off": [],
                              "turn 2 from turn 1's cache vs uncached": []}
    assert "| alone vs a batch of 3 | 0 of 3 | - |" in out.stdout
