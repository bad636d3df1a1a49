#!/bin/sh
# Predicted Outputs: send the text you expect back (here, code to edit); Kiln
# verifies it as draft tokens, so a close prediction decodes several tokens a
# step. The answer is the same as without it; usage tells how much was accepted.
curl -sS --fail-with-body "${KILN_URL:-http://127.0.0.1:8080}/v1/chat/completions" \
  -H 'content-type: application/json' \
  -d '{
    "model": "SmolLM2-135M-Instruct.Q4_1",
    "messages": [{"role": "user", "content": "Rename x to total in: def f(x):\n    return x + 1"}],
    "prediction": {"type": "content", "content": "def f(total):\n    return total + 1"},
    "max_tokens": 64,
    "temperature": 0
  }'
