"""The Anthropic Messages API through the official `anthropic` package."""
import os

from anthropic import Anthropic

client = Anthropic(base_url=os.environ.get("KILN_URL", "http://127.0.0.1:8080"), api_key="unused")
message = client.messages.create(
    model="SmolLM2-135M-Instruct.Q4_1",
    max_tokens=64,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
)
print(message.content[0].text)
