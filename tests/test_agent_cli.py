"""The real agent CLIs (npm: @anthropic-ai/claude-code, @openai/codex; `install.sh --test` installs
them where npm is) against a live server, configured only as their docs say for a custom endpoint.

qwen3-tiny (random weights, the default tokenizer) stands in for a model so that their 9-12k-token
prompts prefill in seconds on a CPU; it never stops by itself, so answers end at a token cap (each
CLI then reports that cap, which shows it parsed the stream's end). Each CLI runs
two turns: every request is answered with a 200, none is sent twice, and the second turn reads
the first one's prompt from the prefix cache.
"""

import json
import os
import shutil
import subprocess

import httpx
import pytest

from mlxserve.config import EngineConfig

MODEL = "qwen3-tiny"
CAP = 16  # output tokens a request gets when it names no limit
TIMEOUT = 600


def cli(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (npm i -g @anthropic-ai/claude-code @openai/codex; "
                    "install.sh --test does it where npm is)")
    return path


@pytest.fixture(scope="module")
def cli_server(tiny):
    from conftest import LiveServer

    live = LiveServer(tiny(MODEL), EngineConfig(max_model_len=40960, max_num_seqs=4, default_max_tokens=CAP))
    live.pool.add_alias("*", MODEL)  # whatever names the CLIs ask for
    yield live
    live.close()


@pytest.fixture
def project(tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    (work / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    subprocess.run(["git", "init", "-q"], cwd=work, check=True)
    return work


def stats(server) -> dict:
    return httpx.get(server.base_url + "/stats", timeout=30).json()["requests"]


def run(command: list[str], cwd, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)


def test_claude_code_two_turns(cli_server, project, tmp_path):
    claude = cli("claude")
    env = {"ANTHROPIC_BASE_URL": cli_server.url, "ANTHROPIC_API_KEY": "none", "HOME": str(tmp_path),
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(CAP), "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    before = stats(cli_server)
    results = []
    for args in (["-p", "Read calc.py and tell me what it does."], ["-c", "-p", "Now run it."]):
        done = run([claude, *args, "--max-turns", "2", "--output-format", "json"], project, env)
        result = json.loads(done.stdout)
        # Cut at the cap, Claude Code asks to go on, then reports the cap (exit 1): it read the
        # stream's stop_reason max_tokens. No request failed at the HTTP level.
        assert done.returncode == 0 or result.get("api_error") == "max_output_tokens", done.stdout[-3000:]
        assert result["api_error_status"] is None and result["type"] == "result"
        results.append(result)
    after = stats(cli_server)
    statuses = {k: after["http_statuses"].get(k, 0) - before["http_statuses"].get(k, 0)
                for k in after["http_statuses"]}
    assert statuses.get("200", 0) >= 2 and sum(v for k, v in statuses.items() if k != "200") == 0, statuses
    assert results[1]["usage"]["cache_read_input_tokens"] > 10_000


def test_codex_two_turns(cli_server, project, tmp_path):
    codex = cli("codex")
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(f'''model = "{MODEL}"
model_provider = "mlxserve"
model_context_window = 40960

[model_providers.mlxserve]
name = "mlxserve"
base_url = "{cli_server.base_url}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0

[features]
plugins = false
[analytics]
enabled = false
''')
    env = {"CODEX_HOME": str(home), "HOME": str(tmp_path)}
    flags = ["--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    turns = [[codex, "exec", *flags, "Read calc.py and tell me what it does."],
             [codex, "exec", "resume", "--last", *flags, "Now run it."]]
    cached = []
    for command in turns:
        before = stats(cli_server)
        done = run(command, project, env)
        after = stats(cli_server)
        # The answer stops at the cap: Codex reads response.incomplete and says so (exit 1).
        out = done.stdout + done.stderr
        assert "Incomplete response returned, reason: max_output_tokens" in out, out[-3000:]
        finished = {k: v - before["finished"].get(k, 0) for k, v in after["finished"].items()}
        assert {k: v for k, v in finished.items() if v} == {"length": 1}, (finished, out[-3000:])  # sent once
        assert set(after["http_statuses"]) == {"200"}
        cached.append(after["cached_prompt_tokens"] - before["cached_prompt_tokens"])
    assert cached[1] > 8_000
