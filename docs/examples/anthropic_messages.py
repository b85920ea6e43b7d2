"""Ask a running `mlxserve serve` through the official Anthropic SDK (its Messages API).

    MLXSERVE_BASE_URL  the server's /v1 URL (default http://127.0.0.1:8000/v1; the SDK adds /v1 itself)
    MLXSERVE_API_KEY   the key, if the server runs with --api-key
    MLXSERVE_MODEL     the served model's name (default: the embedded model's)
"""

import os

import anthropic

base_url = os.environ.get("MLXSERVE_BASE_URL", "http://127.0.0.1:8000/v1").removesuffix("/v1")
client = anthropic.Anthropic(base_url=base_url, api_key=os.environ.get("MLXSERVE_API_KEY", "none"))
msg = client.messages.create(
    model=os.environ.get("MLXSERVE_MODEL", "Qwen2.5-Coder-0.5B-Instruct"),
    max_tokens=64,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    extra_body={"temperature": 0},  # greedy; the API's default is 1.0 (recent SDKs take no `temperature`)
)
print(msg.content[0].text)
print(f"[{msg.usage.input_tokens} input + {msg.usage.output_tokens} output tokens, stop: {msg.stop_reason}]")
