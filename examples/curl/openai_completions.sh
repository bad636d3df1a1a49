#!/bin/sh
# OpenAI (legacy) completions with curl.
curl -sS --fail-with-body "${KILN_URL:-http://127.0.0.1:8080}/v1/completions" \
  -H 'content-type: application/json' \
  -d '{
    "model": "SmolLM2-135M-Instruct.Q4_1",
    "prompt": "The capital of France is",
    "max_tokens": 16,
    "temperature": 0
  }'
