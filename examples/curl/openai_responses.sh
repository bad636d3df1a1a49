#!/bin/sh
# The OpenAI Responses API with curl (stateless: send the whole conversation).
curl -sS --fail-with-body "${KILN_URL:-http://127.0.0.1:8080}/v1/responses" \
  -H 'content-type: application/json' \
  -d '{
    "model": "SmolLM2-135M-Instruct.Q4_1",
    "instructions": "Answer in one sentence.",
    "input": "What is the capital of France?",
    "max_output_tokens": 64,
    "temperature": 0
  }'
