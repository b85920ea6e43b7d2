"""`mlxserve bench serve --start`: the command starts each server on one model folder in turn,
measures it, stops it, and compares them in one result; a server that cannot start is reported."""

import argparse
import json
import os
import subprocess
import sys

import pytest

from mlxserve.bench import serve as bench
from mlxserve.bench.local import healthy

OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """qwen3-tiny with random weights as an MLX folder that mlx_lm (and vllm-mlx) can load."""
    out = tmp_path_factory.mktemp("peers") / "qwen3-tiny"
    subprocess.run([sys.executable, "-m", "mlxserve.cli", "convert", "--load-format", "dummy", "qwen3-tiny",
                    "--out-dir", str(out)], check=True, capture_output=True)
    return out


def bench_start(tmp_path, *flags) -> tuple[int, str, list[dict]]:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", *flags, "--concurrency", "1,2", "--requests", "3", "--input-len", "16",
                              "--output-len", str(OUTPUT_LEN), "--endpoint", "completions",
                              "--start-timeout", "120", "--out-dir", str(tmp_path)])
    rc = args.func(args)
    (md,) = tmp_path.glob("*.md")
    return rc, md.read_text(), json.loads(md.with_suffix(".json").read_text())["results"]


def test_start_runs_mlxserve_and_mlx_lm_one_after_the_other(model_dir, tmp_path):
    rc, text, runs = bench_start(tmp_path, "--start", "mlxserve,mlx_lm", "--model-dir", str(model_dir))
    assert rc == 0
    assert [r["label"] for r in runs] == ["mlxserve", "mlx_lm"]
    for r in runs:
        assert "error" not in r and [row["concurrency"] for row in r["rows"]] == [1, 2]
        assert all(row["failed"] == 0 and row["mean_output_tokens"] > 0 for row in r["rows"])
        assert not healthy(r["url"].removesuffix("/v1"))  # stopped once measured
    mlxserve, mlx_lm = runs
    assert mlxserve["rows"][0]["mean_output_tokens"] == OUTPUT_LEN and mlxserve["ignore_eos"]
    assert mlx_lm["model"] == "default_model" and not mlx_lm["ignore_eos"]  # mlx_lm.server has no ignore_eos
    assert mlxserve["url"] != mlx_lm["url"]
    side = text.split("## Side by side")[1]
    assert "mlxserve tok/s" in side and "mlx_lm tok/s" in side
    assert len([line for line in side.splitlines() if line.startswith(("| 1 |", "| 2 |"))]) == 2
    # Where the first token's time goes: from mlxserve's /metrics; mlx_lm.server has none ("-").
    assert all(row[key] >= 0 for row in mlxserve["rows"] for key in ("queue_mean_ms", "prefill_mean_ms",
                                                                     "first_step_mean_ms"))
    assert all(row["queue_mean_ms"] is None for row in mlx_lm["rows"])
    assert side.splitlines()[4].endswith(" | - |")  # level 1's row: mlx_lm's phases, the last column


def test_a_server_that_fails_to_start_is_reported_in_the_result(model_dir, tmp_path):
    rc, text, runs = bench_start(tmp_path, "--start", "mlx_lm", "--model-dir", str(model_dir),
                                 "--peer-args", "mlx_lm=--no-such-flag")
    assert rc == 1
    (run,) = runs
    assert run["rows"] == [] and "exited with 2 while starting" in run["error"]
    assert "Did not run: exited with 2" in text and "unrecognized arguments: --no-such-flag" in text


def test_start_runs_vllm_mlx(model_dir, tmp_path):
    # vllm-mlx pins an older mlx-lm than mlxserve, so it lives in its own folder of packages.
    path = os.environ.get("MLXSERVE_TEST_VLLM_MLX_PATH")
    found = subprocess.run([sys.executable, "-c", "import vllm_mlx"], capture_output=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               p for p in (path, os.environ.get("PYTHONPATH")) if p)}).returncode == 0
    if not found:
        pytest.skip("vllm-mlx is not installed: set MLXSERVE_TEST_VLLM_MLX_PATH to a folder of its packages "
                    "(pip install --target DIR --no-deps vllm-mlx mlx-lm==0.31.3 jsonschema python-multipart ...)")
    flags = ["--peer-path", f"vllm-mlx={path}"] if path else []
    rc, text, runs = bench_start(tmp_path, "--start", "vllm-mlx", "--model-dir", str(model_dir), *flags)
    (run,) = runs
    assert rc == 0, run.get("error")
    assert run["server"]["mode"].startswith("--continuous-batching")
    assert all(row["failed"] == 0 and row["mean_output_tokens"] > 0 for row in run["rows"])
    assert not healthy(run["url"].removesuffix("/v1"))


def test_a_server_that_stops_answering_does_not_hold_the_run(tmp_path):
    """It answers the warm-up, then never again: the run stops at the first level's first timeout
    instead of waiting --timeout for every request left."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    released = threading.Event()
    answered = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if answered:
                released.wait(30)
                return
            answered.append(1)
            chunks = [{"choices": [{"index": 0, "text": "hi"}]},
                      {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 1}}]
            body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        parser = argparse.ArgumentParser()
        bench.add_parser(parser.add_subparsers())
        args = parser.parse_args(["serve", "--url", f"http://127.0.0.1:{httpd.server_port}/v1", "--model", "m",
                                  "--concurrency", "1,2", "--requests", "20", "--endpoint", "completions",
                                  "--timeout", "1", "--out-dir", str(tmp_path)])
        start = time.monotonic()
        assert args.func(args) == 1
        assert time.monotonic() - start < 10  # not 20 requests x 1 s, nor the second level
    finally:
        released.set()
        httpd.shutdown()
    (run,) = json.loads(next(tmp_path.glob("*.json")).read_text())["results"]
    (row,) = run["rows"]
    assert row["concurrency"] == 1 and row["failed"] >= 1 and "within 1 s" in row["stopped"]
    assert "Stopped at concurrency 1" in next(tmp_path.glob("*.md")).read_text()
