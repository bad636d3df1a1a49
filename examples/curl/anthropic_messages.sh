#!/bin/sh
# The Anthropic Messages API with curl.
curl -sS --fail-with-body "${KILN_URL:-http://127.0.0.1:8080}/v1/messages" \
  -H 'content-type: application/json' \
  -H 'anthropic-version: 2023-06-01' \
  -d '{
    "model": "SmolLM2-135M-Instruct.Q4_1",
    "max_tokens": 64,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0
  }'
