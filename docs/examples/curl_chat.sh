#!/usr/bin/env sh
# Chat with a running `mlxserve serve` over plain HTTP.
#   MLXSERVE_BASE_URL  the server's /v1 URL (default http://127.0.0.1:8000/v1)
#   MLXSERVE_API_KEY   the key, if the server runs with --api-key
# "model" may be left out: the server serves one model.
set -eu
BASE_URL="${MLXSERVE_BASE_URL:-http://127.0.0.1:8000/v1}"

curl -sS --fail-with-body "$BASE_URL/chat/completions" \
  -H "Content-Type: application/json" \
  -H "Authorization: Bearer ${MLXSERVE_API_KEY:-none}" \
  -d '{
    "messages": [
      {"role": "system", "content": "You are a concise assistant."},
      {"role": "user", "content": "Write a haiku about the sea."}
    ],
    "max_tokens": 64,
    "temperature": 0.7
  }'
echo
