#!/usr/bin/env python3
"""Tool calling on a real model whose chat template renders tools and
`<tool_call>` turns: `kiln serve` on Qwen2.5-Coder-0.5B-Instruct, driven by
the official OpenAI and Anthropic SDKs, greedy.

- `tool_choice: auto` on a prompt where the model chooses to call the tool,
  then the tool's result sent back and answered in text (a round trip);
- `required` on a prompt where it would not call on its own, and a named
  tool among two: calls valid against the tool's schema (`jsonschema`);
- every case streamed too: the concatenated deltas (OpenAI
  `delta.tool_calls`, Anthropic `input_json_delta`, Responses
  `function_call_arguments.delta`) equal the non-streamed call;
- Anthropic `tool_use` and a `tool_result` with `is_error`;
- a `strict` tool under `auto`, sampled at temperature 1 over several
  seeds: every call holds to the schema (enums, no undeclared key), and
  the Responses API, whose tools are strict unless they say otherwise.

    python3 tests/tools/qwen_tools.py KILN_BINARY QWEN.gguf

Prints one `test result:` line in cargo's format so scripts/test.sh counts it.
"""
import json
import socket
import subprocess
import sys
import time
import traceback
import urllib.request

import anthropic
import jsonschema
import openai

KILN, MODEL = sys.argv[1], sys.argv[2]
NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "description": "An IANA timezone such as Europe/Paris"}},
            "required": ["timezone"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
# Strict: enums the model does not know, and no `additionalProperties`.
STRICT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
# Greedy Qwen2.5-Coder-0.5B calls get_weather here on its own.
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
GREET = [{"role": "user", "content": "Hello! Who are you?"}]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server():
    port = free_port()
    proc = subprocess.Popen([KILN, "serve", MODEL, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited: {proc.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("kiln serve did not become ready")


def call_of(message):
    """(name, arguments as JSON) of the only tool call of a chat message."""
    assert message.tool_calls and len(message.tool_calls) == 1, message
    c = message.tool_calls[0]
    return c.function.name, json.loads(c.function.arguments)


def streamed_chat(client, **kw):
    """Content and calls rebuilt from the stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        finish = ch.finish_reason or finish
        d = ch.delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
    return content, [calls[i] for i in sorted(calls)], finish


def check_same_streamed(client, whole, **kw):
    content, calls, finish = streamed_chat(client, **kw)
    msg = whole.choices[0].message
    assert finish == whole.choices[0].finish_reason, (finish, whole.choices[0].finish_reason)
    assert content == (msg.content or ""), (content, msg.content)
    want = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
    got = [(c["name"], json.loads(c["arguments"])) for c in calls]
    assert got == want, (got, want)
    assert all(c["id"] for c in calls), calls


def test_auto_round_trip(client):
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=80)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls", r
    name, args = call_of(r.choices[0].message)
    assert name == "get_weather" and args == {"city": "Paris"}, (name, args)
    check_same_streamed(client, r, **kw)
    # The tool's answer goes back; the model answers in words.
    call = r.choices[0].message.tool_calls[0]
    follow = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "sunny"})},
    ]
    # `none`: the model must answer in words, from the tool's result.
    r2 = client.chat.completions.create(model=NAME, messages=follow, tools=[WEATHER], tool_choice="none",
                                        temperature=0, max_tokens=60)
    text = r2.choices[0].message.content or ""
    assert not r2.choices[0].message.tool_calls, r2
    assert "18" in text or "sunny" in text.lower(), text


def test_required_and_named(client):
    kw = dict(model=NAME, messages=GREET, tools=[WEATHER, TIME], temperature=0, max_tokens=80)
    free = client.chat.completions.create(**kw)
    assert not free.choices[0].message.tool_calls, "the greeting must not call on its own"
    r = client.chat.completions.create(tool_choice="required", **kw)
    name, args = call_of(r.choices[0].message)
    jsonschema.validate(args, SCHEMAS[name])
    assert r.choices[0].finish_reason == "tool_calls"
    check_same_streamed(client, r, tool_choice="required", **kw)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(tool_choice=named, **kw)
    name, args = call_of(r.choices[0].message)
    assert name == "get_time", name
    jsonschema.validate(args, SCHEMAS["get_time"])
    check_same_streamed(client, r, tool_choice=named, **kw)


def test_strict_auto(client):
    schema = dict(STRICT_WEATHER["function"]["parameters"], additionalProperties=False)
    calls = 0
    for temperature, seed in [(0, 0), (1, 1), (1, 2), (1, 3)]:
        kw = dict(model=NAME, messages=ASK, tools=[STRICT_WEATHER], tool_choice="auto",
                  temperature=temperature, seed=seed, max_tokens=60)
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        for tc in c.message.tool_calls or []:
            assert tc.function.name == "get_weather", tc
            jsonschema.validate(json.loads(tc.function.arguments), schema)
            calls += 1
        # Text (even a call written without its tags) is left as written.
        assert c.finish_reason in (("tool_calls",) if c.message.tool_calls else ("stop", "length")), c
        if temperature == 0:
            assert c.message.tool_calls, "greedy, the model calls the tool here"
            check_same_streamed(client, r, **kw)
    assert calls > 1, f"{calls} call(s) in 4 answers"
    # Anthropic's strict tool use: the call holds, and is still read as a
    # `tool_use` block (not as a forced call).
    f = STRICT_WEATHER["function"]
    tool = {"name": f["name"], "description": f["description"], "input_schema": f["parameters"], "strict": True}
    m = anthropic.Anthropic(base_url=str(client.base_url)[:-len("/v1/")], api_key="none").messages.create(
        model=NAME, max_tokens=60, temperature=0, tools=[tool], messages=ASK)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1, m
    jsonschema.validate(uses[0].input, schema)


def anthropic_tool(t):
    f = t["function"]
    return {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}


def test_anthropic_tool_use(base):
    client = anthropic.Anthropic(base_url=base, api_key="none")
    kw = dict(model=NAME, max_tokens=80, temperature=0, tools=[anthropic_tool(WEATHER)], messages=ASK)
    m = client.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1, m
    assert (uses[0].name, uses[0].input) == ("get_weather", {"city": "Paris"}), uses
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in m.content], (final.content, m.content)
    # A forced tool (`tool`) and the error of a failed call sent back.
    forced = client.messages.create(**{**kw, "messages": GREET, "tools": [anthropic_tool(WEATHER), anthropic_tool(TIME)],
                                       "tool_choice": {"type": "tool", "name": "get_time"}})
    use = next(b for b in forced.content if b.type == "tool_use")
    assert use.name == "get_time", use
    jsonschema.validate(use.input, SCHEMAS["get_time"])
    follow = ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "is_error": True,
                                      "content": "the weather service is down"}]},
    ]
    m2 = client.messages.create(**{**kw, "messages": follow, "max_tokens": 60})
    assert m2.stop_reason in ("end_turn", "max_tokens", "tool_use"), m2


def test_responses_function_call(client):
    tool = {"type": "function", **WEATHER["function"]}
    kw = dict(model=NAME, input=ASK[0]["content"], tools=[tool], temperature=0, max_output_tokens=80)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", r.output
    args = json.loads(calls[0].arguments)
    assert args == {"city": "Paris"}, args
    deltas, done = "", None
    for ev in client.responses.create(stream=True, **kw):
        if ev.type == "response.function_call_arguments.delta":
            deltas += ev.delta
        if ev.type == "response.completed":
            done = ev.response
    assert json.loads(deltas) == args, deltas
    assert [o.type for o in done.output] == [o.type for o in r.output], (done.output, r.output)


def main():
    proc, base = start_server()
    client = openai.OpenAI(base_url=base + "/v1", api_key="none")
    tests = [
        ("auto call, stream = whole, round trip", lambda: test_auto_round_trip(client)),
        ("required and named, stream = whole", lambda: test_required_and_named(client)),
        ("anthropic tool_use, stream = whole, is_error", lambda: test_anthropic_tool_use(base)),
        ("responses function_call, stream = whole", lambda: test_responses_function_call(client)),
        ("strict tool under auto, temperature 1", lambda: test_strict_auto(client)),
    ]
    passed = failed = 0
    try:
        for name, fn in tests:
            try:
                fn()
                print(f"test qwen_tools::{name} ... ok")
                passed += 1
            except Exception:
                print(f"test qwen_tools::{name} ... FAILED")
                traceback.print_exc()
                failed += 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"test result: {'ok' if not failed else 'FAILED'}. {passed} passed; {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
