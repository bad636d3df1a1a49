"""The OpenAI Responses API through the official `openai` package, streamed.
Kiln is stateless: send the whole conversation in `input` each time."""
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("KILN_URL", "http://127.0.0.1:8080") + "/v1", api_key="unused")
stream = client.responses.create(
    model="SmolLM2-135M-Instruct.Q4_1",
    instructions="Answer in one sentence.",
    input=[{"role": "user", "content": "What is the capital of France?"}],
    max_output_tokens=64,
    temperature=0,
    stream=True,
)
for event in stream:
    if event.type == "response.output_text.delta":
        print(event.delta, end="", flush=True)
print()
