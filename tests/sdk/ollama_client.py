#!/usr/bin/env python3
"""Kiln's Ollama API through the official `ollama` Python client, unchanged:
`kiln serve` on SmolLM2 — list, show, ps, chat and generate (whole and
streamed, each the same text as Kiln's OpenAI route gives for the same
greedy request), a JSON-schema `format`, embed (the vectors of
`/v1/embeddings`), an unknown model
as the client's `ResponseError` 404 — and on Qwen2.5-Coder-0.5B a chat with
a tool, whose call comes back with its arguments as a dict, whole and
streamed.

    python3 tests/sdk/ollama_client.py KILN_BINARY MODELS_DIR

Prints one `test result:` line in cargo's format so scripts/test.sh counts it.
"""
import json
import pathlib
import re
import subprocess
import sys
import time
import traceback
import urllib.request

import ollama

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import kiln_server  # noqa: E402

KILN, MODELS = sys.argv[1], pathlib.Path(sys.argv[2])
CLIENT = "ollama-0.6.3"
QUESTION = "What is the capital of France? Answer in one sentence."


def start(model):
    return kiln_server.start(KILN, model)


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main():
    smol, smol_url = start(MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf")
    qwen, qwen_url = start(MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    c = ollama.Client(host=smol_url)
    q = ollama.Client(host=qwen_url)
    name = c.list().models[0].model
    options = {"num_predict": 12, "temperature": 0}
    openai = post(smol_url, "/v1/chat/completions",
                  {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "temperature": 0})
    want = openai["choices"][0]["message"]["content"]
    tests = []

    def test(f):
        tests.append(f)
        return f

    @test
    def list_show_ps():
        assert name, name
        shown = c.show(name)
        assert "completion" in (shown.capabilities or []), shown
        assert shown.template and "im_start" in shown.template
        running = c.ps()
        assert running.models[0].model == name, running

    @test
    def chat_whole_and_streamed():
        r = c.chat(model=name, messages=[{"role": "user", "content": QUESTION}], options=options)
        assert r.message.role == "assistant"
        assert r.message.content == want, (r.message.content, want)
        assert r.done and r.eval_count == openai["usage"]["completion_tokens"], r
        parts = list(c.chat(model=name, messages=[{"role": "user", "content": QUESTION}],
                            options=options, stream=True))
        assert len(parts) > 2 and parts[-1].done
        assert "".join(p.message.content for p in parts) == want

    @test
    def generate_whole_and_streamed():
        r = c.generate(model=name, prompt=QUESTION, options=options)
        assert r.response == want, (r.response, want)
        text = "".join(p.response for p in c.generate(model=name, prompt=QUESTION, options=options, stream=True))
        assert text == want

    @test
    def embed_is_the_openai_embedding():
        r = c.embed(model=name, input=["a cat", "Paris"])
        o = post(smol_url, "/v1/embeddings", {"input": ["a cat", "Paris"]})
        assert len(r.embeddings) == 2
        for got, d in zip(r.embeddings, o["data"]):
            assert list(got) == d["embedding"]

    @test
    def format_schema_gives_json():
        schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                  "additionalProperties": False}
        r = c.chat(model=name, messages=[{"role": "user", "content": "Name a city in France as JSON."}],
                   format=schema, options={"num_predict": 100, "temperature": 0})
        v = json.loads(r.message.content)
        assert isinstance(v["city"], str), v

    @test
    def unknown_model_is_a_404():
        try:
            c.chat(model="llama9:70b", messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("an unknown model answered")
        except ollama.ResponseError as e:
            assert e.status_code == 404 and "llama9:70b" in e.error, e

    @test
    def tool_call_with_object_arguments():
        qname = q.list().models[0].model

        def get_weather(city: str) -> str:
            """The current weather in a city.

            Args:
              city: The city's name
            """
            return "sunny"

        messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        r = q.chat(model=qname, messages=messages, tools=[get_weather],
                   options={"num_predict": 60, "temperature": 0})
        call = r.message.tool_calls[0].function
        assert call.name == "get_weather", r
        assert isinstance(call.arguments, dict) and "paris" in json.dumps(call.arguments).lower(), call
        streamed = [t for p in q.chat(model=qname, messages=messages, tools=[get_weather], stream=True,
                                      options={"num_predict": 60, "temperature": 0})
                    for t in (p.message.tool_calls or [])]
        assert len(streamed) == 1 and streamed[0].function == call, streamed
        # The call's result goes back as a tool message; the model answers.
        messages += [r.message, {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
        again = q.chat(model=qname, messages=messages, tools=[get_weather],
                       options={"num_predict": 40, "temperature": 0})
        assert again.message.content or again.message.tool_calls, again

    passed = failed = 0
    try:
        for t in tests:
            try:
                started = time.monotonic()
                t()
                print(f"test sdk::{CLIENT}::{t.__name__} ... ok ({time.monotonic() - started:.1f} s)")
                passed += 1
            except Exception:
                print(f"test sdk::{CLIENT}::{t.__name__} ... FAILED")
                traceback.print_exc()
                failed += 1
    finally:
        for p in (smol, qwen):
            p.terminate()
            p.wait(timeout=60)
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed; 0 ignored")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
