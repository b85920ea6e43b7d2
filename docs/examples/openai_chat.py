"""Chat with a running `mlxserve serve` through the official OpenAI SDK, streaming.

    MLXSERVE_BASE_URL  the server's /v1 URL (default http://127.0.0.1:8000/v1)
    MLXSERVE_API_KEY   the key, if the server runs with --api-key
"""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("MLXSERVE_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("MLXSERVE_API_KEY", "none"),  # the SDK insists on some key
)
model = client.models.list().data[0].id  # the one model the server serves

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Explain continuous batching in two sentences."}],
    max_tokens=64,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} generated tokens]")
