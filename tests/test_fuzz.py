"""Schema fuzzing: every request the OpenAPI document allows, and many it does not, gets
an answer that is not a 500 (and the server lives on).

schemathesis generates request bodies from the server's own `/openapi.json`:
valid ones (positive) and ones that break the schema (negative), a bounded
number per operation, within a wall-clock budget. The server's context is
short (`max_model_len`), so whatever `max_tokens` a case asks for, a request
generates at most a few dozen tokens.
"""

import os
import time
from collections import Counter

import httpx
import hypothesis
import pytest
import schemathesis
from schemathesis import GenerationMode

# Examples per operation and mode; MLXSERVE_FUZZ_EXAMPLES raises it for a longer local run.
EXAMPLES = int(os.environ.get("MLXSERVE_FUZZ_EXAMPLES", "100"))
BUDGET_S = float(os.environ.get("MLXSERVE_FUZZ_BUDGET_S", "30"))  # CI: the suite keeps under 30 min
CONTEXT = 32  # the fuzzed server's max_model_len
MAX_N = 8  # choices per request (the schema allows 128: a few seconds each on 2 CPU cores)
MODEL = "qwen3-tiny"


@pytest.fixture(scope="module")
def fuzz_server(tiny):
    from conftest import LiveServer
    from mlxserve.config import EngineConfig

    live = LiveServer(tiny(MODEL), EngineConfig(max_num_seqs=8, max_queue=512, max_model_len=CONTEXT))
    yield live
    live.close()


def error_shape_ok(path: str, response) -> bool:
    """A 4xx body in the API's own shape (Anthropic's on /v1/messages*, OpenAI's elsewhere)."""
    try:
        body = response.json()
    except ValueError:
        return False
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and {"type", "message"} <= set(body.get("error") or {})
    return set(body.get("error") or {}) == {"message", "type", "param", "code"}


class OutOfTime(Exception):
    """Ends one operation's run at its deadline: returning early would still let hypothesis
    generate (slowly) every remaining example."""


def test_no_request_gets_a_500(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    start = time.monotonic()
    statuses: Counter = Counter()
    errors: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 8  # the schema lists the API, not a stub
    runs = [(op, mode) for op in operations for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]

    for i, (operation, mode) in enumerate(runs):
        # Each run gets an equal share of what is left of the budget: a slow machine
        # fuzzes every operation less, rather than the last ones not at all.
        deadline = time.monotonic() + (BUDGET_S - (time.monotonic() - start)) / (len(runs) - i)

        @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                             phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
                             suppress_health_check=list(hypothesis.HealthCheck))
        @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case):
            if time.monotonic() > deadline:
                raise OutOfTime
            if isinstance(case.body, dict):
                if isinstance(case.body.get("model"), str):
                    case.body["model"] = MODEL  # else nearly every case stops at "no such model" (404)
                if isinstance(case.body.get("n"), int) and case.body["n"] > MAX_N:
                    case.body["n"] = MAX_N  # n up to 128 is valid, and slow on a small CPU
            response = case.call(base_url=fuzz_server.url, timeout=120)
            statuses[response.status_code] += 1
            what = f"{operation.label} {response.status_code}: body {case.body!r:.300} -> {response.text[:300]}"
            if response.status_code >= 500:
                errors.append(what)
            elif response.status_code >= 400 and not error_shape_ok(operation.path, response):
                errors.append("not in the API's error shape: " + what)

        try:
            fuzz()
        except OutOfTime:
            pass
        except hypothesis.errors.Unsatisfiable:
            assert mode == GenerationMode.NEGATIVE  # nothing to break: the operation takes no input

    sent = sum(statuses.values())
    print(f"\n{sent} requests in {time.monotonic() - start:.0f} s: {dict(sorted(statuses.items()))}")
    assert not errors, f"{len(errors)} of {sent} requests failed:\n" + "\n".join(errors[:20])
    assert sent >= 100  # the budget let the fuzzer run
    assert httpx.get(fuzz_server.url + "/health", timeout=10).json()["status"] == "ok"
    r = httpx.post(fuzz_server.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
