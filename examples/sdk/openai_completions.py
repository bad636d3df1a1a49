"""OpenAI (legacy) completions through the official `openai` package."""
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("KILN_URL", "http://127.0.0.1:8080") + "/v1", api_key="unused")
completion = client.completions.create(
    model="SmolLM2-135M-Instruct.Q4_1",
    prompt="The capital of France is",
    max_tokens=16,
    temperature=0,
)
print(completion.choices[0].text)
