"""The embedded default model, end to end through the Python API and the CLI."""

import subprocess
import sys

import pytest

from mlxserve import LLM, SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:  # no model named: the embedded Qwen2.5-Coder-0.5B-Instruct
        yield llm


def test_default_model_answers_paris_through_its_chat_template(llm):
    (out,) = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=10))
    assert "Paris" in out.text
    assert out.prompt_tokens > 10  # the chat template's system prompt is there


def test_generate_batch_matches_single(llm):
    params = SamplingParams(temperature=0, max_tokens=4)
    prompts = ["def fibonacci(n):", "The capital of Italy is", "import numpy as"]
    batch = llm.generate(prompts, params)
    single = llm.generate(prompts[1], params)
    assert batch[1].token_ids == single[0].token_ids
    assert all(len(o.token_ids) >= 1 for o in batch)


def test_cli_generate_prints_a_completion():
    out = subprocess.run(
        [sys.executable, "-m", "mlxserve.cli", "generate", "The capital of France is",
         "--max-tokens", "3"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "convert", "bench engine",
                                     "bench serve", "bench prefix", "bench soak"])
def test_cli_help_lists_the_settings(command):
    out = subprocess.run([sys.executable, "-m", "mlxserve.cli", *command.split(), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: mlxserve" in out.stdout
    if command == "serve":
        for flag in ("--cache-memory", "--max-num-seqs", "--api-key", "--no-prefix-cache", "--load-format"):
            assert flag in out.stdout
