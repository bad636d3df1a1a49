#!/bin/sh
# OpenAI chat completions with curl.
curl -sS --fail-with-body "${KILN_URL:-http://127.0.0.1:8080}/v1/chat/completions" \
  -H 'content-type: application/json' \
  -d '{
    "model": "SmolLM2-135M-Instruct.Q4_1",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 64,
    "temperature": 0
  }'
