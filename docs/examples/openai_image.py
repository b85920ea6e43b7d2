"""Ask a vision-language model about an image twice, through the official OpenAI SDK.

    mlxserve serve --load-format dummy qwen2.5-vl-tiny    # or a real VLM folder / repo id
    python docs/examples/openai_image.py [IMAGE]          # default: a generated picture

The second question reuses the image's embeddings (GET /v1/cache/stats shows
the vision-cache hit) and the KV of the first turn's prompt and answer
(`cached_tokens` in the usage counts them, to the token).

    MLXSERVE_BASE_URL  the server's /v1 URL (default http://127.0.0.1:8000/v1)
    MLXSERVE_API_KEY   the key, if the server runs with --api-key
"""

import base64
import io
import os
import sys

from openai import OpenAI
from PIL import Image

if len(sys.argv) > 1:
    image = Image.open(sys.argv[1])
else:
    image = Image.radial_gradient("L").convert("RGB").resize((320, 240))
buf = io.BytesIO()
image.save(buf, "PNG")
url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

client = OpenAI(
    base_url=os.environ.get("MLXSERVE_BASE_URL", "http://127.0.0.1:8000/v1"),
    api_key=os.environ.get("MLXSERVE_API_KEY", "none"),
)
model = client.models.list().data[0].id
messages = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": url}},
    {"type": "text", "text": "What is in this picture?"},
]}]
for question in ("What is in this picture?", "What colors does it have?"):
    messages[-1]["content"][1]["text"] = question
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0)
    usage = reply.usage
    print(f"Q: {question}\nA: {reply.choices[0].message.content}")
    print(f"[{usage.prompt_tokens} prompt tokens, {usage.prompt_tokens_details.cached_tokens} from the cache]\n")
