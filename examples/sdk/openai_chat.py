"""OpenAI chat completions through the official `openai` package."""
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("KILN_URL", "http://127.0.0.1:8080") + "/v1", api_key="unused")
completion = client.chat.completions.create(
    model="SmolLM2-135M-Instruct.Q4_1",
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=64,
    temperature=0,
)
print(completion.choices[0].message.content)
