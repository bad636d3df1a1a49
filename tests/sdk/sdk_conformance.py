#!/usr/bin/env python3
"""Kiln's server driven by the official OpenAI and Anthropic Python SDKs
(installed from PyPI by scripts/test.sh): `kiln serve` on SmolLM2 on a free
loopback port, then chat (plain and streaming), completions, logprobs, seeds,
stop sequences, cached tokens on a repeated prefix, the Responses API (plain,
streamed, a function tool round trip, stateless refusals), Anthropic messages
(plain, streaming, count_tokens, a tool result with is_error), and errors as
each SDK sees them. Then every example in examples/sdk and examples/curl runs
against the server, and the README must show each one byte for byte.

    python3 tests/sdk/sdk_conformance.py KILN_BINARY MODEL.gguf [--sdk-only]

scripts/test.sh runs it twice: with the pinned SDK versions and with the
newest ones tested (scripts/install-sdks.sh says which). The second run passes
`--sdk-only`, which leaves out the tests of the model's behaviour under the
server's defaults (ten sampled answers, ten greedy ones): they send the same
plain chat request whatever the SDK version, and every SDK-facing call is
still made.

Prints one `test result:` line in cargo's format so scripts/test.sh counts it.
"""
import concurrent.futures
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request

import anthropic
import openai

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from kiln_server import start, wait_ready  # noqa: E402,F401 (wait_ready: for the suites that import it from here)

KILN, MODEL = sys.argv[1], sys.argv[2]
SDK_ONLY = "--sdk-only" in sys.argv[3:]
SDKS = f"openai-{openai.__version__}+anthropic-{anthropic.__version__}"
NAME = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PARIS = "The capital of France is Paris."
# The flags scripts/run.sh serves the default model with.
RUN_SH_FLAGS = ("--temperature", "0")
# anthropic 2.x dropped `temperature` from `messages.create`; the field still
# goes through the request body.
GREEDY = {"temperature": 0}
ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples" / "sdk").glob("*.py")) + sorted((ROOT / "examples" / "curl").glob("*.sh"))
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def weather_questions():
    """Two worked examples, so that greedy SmolLM2 answers the third question with a call."""
    items = []
    for city in ("London", "Berlin"):
        items.append({"role": "user", "content": f"Weather in {city}?"})
        items.append({"role": "assistant",
                      "content": json.dumps({"name": "get_weather", "arguments": {"city": city}})})
    return items + [{"role": "user", "content": "Weather in Paris?"}]


def answer_text(v):
    """The generated text of a chat, completion, Responses or Anthropic body."""
    if "choices" in v:
        c = v["choices"][0]
        return c["message"]["content"] if "message" in c else c["text"]
    if v.get("object") == "response":
        return "".join(p["text"] for item in v["output"] if item["type"] == "message" for p in item["content"])
    return "".join(b["text"] for b in v["content"] if b["type"] == "text")


def start_server(*extra):
    p, base = start(KILN, MODEL, *extra, timeout=120)
    return p, base + "/v1"


def main():
    server, url = start_server()
    keyed, keyed_url = start_server("--api-key", "sekrit")
    strict, strict_url = start_server("--strict-params")
    greedy, greedy_url = start_server(*RUN_SH_FLAGS)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    tests = []

    def test(f):
        tests.append(f)
        return f

    def model_test(f):
        """A test of the model's behaviour, not of the SDK (see --sdk-only)."""
        if not SDK_ONLY:
            tests.append(f)
        return f

    @test
    def chat_greedy():
        r = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0)
        assert r.choices[0].message.content == "The capital of France is Paris.", r
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.prompt_tokens == 37 and r.usage.completion_tokens > 0

    @test
    def chat_streaming_equals_non_streaming():
        chunks = list(client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "The capital of France is Paris.", text
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 37

    @test
    def completions_with_token_prompt():
        r = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=3, temperature=0)
        assert r.choices[0].text.strip().startswith("Paris"), r.choices[0].text

    @test
    def logprobs():
        r = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=4,
                                           logprobs=True, top_logprobs=3)
        lp = r.choices[0].logprobs.content
        assert len(lp) == 4 and len(lp[0].top_logprobs) == 3
        assert lp[0].top_logprobs[0].token == lp[0].token

    @test
    def seeded_sampling_repeats():
        kw = dict(model=NAME, messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0,
                  seed=42, max_tokens=16)
        a = client.chat.completions.create(**kw).choices[0].message.content
        b = client.chat.completions.create(**kw).choices[0].message.content
        assert a == b, (a, b)

    @test
    def several_choices_seeded_and_streamed():
        kw = dict(model=NAME, messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.0,
                  seed=7, max_tokens=8)
        r = client.chat.completions.create(n=3, **kw)
        assert [c.index for c in r.choices] == [0, 1, 2], r
        assert 3 <= r.usage.completion_tokens <= 3 * 8, r.usage
        one = client.chat.completions.create(n=1, **kw)
        assert one.choices[0].message.content == r.choices[0].message.content, (one, r)
        assert r.usage.prompt_tokens == one.usage.prompt_tokens
        texts = {}
        for c in client.chat.completions.create(n=3, stream=True, **kw):
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices], (texts, r)
        try:
            client.chat.completions.create(n=9, **kw)
            raise AssertionError("n = 9 accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "n" in str(e)

    @test
    def structured_output_json_schema():
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                   "country": {"type": "string", "maxLength": 24}},
                  "required": ["city", "country"], "additionalProperties": False}
        r = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
            temperature=0, max_tokens=64,
            response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema, "strict": True}})
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"city", "country"} and all(isinstance(v, str) and len(v) <= 24 for v in value.values()), value
        r = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, max_tokens=8,
                                           extra_body={"guided_choice": ["Paris", "Lyon"]})
        assert r.choices[0].message.content in ("Paris", "Lyon"), r.choices[0].message.content
        try:
            client.chat.completions.create(model=NAME, messages=QUESTION, extra_body={"guided_regex": "(unclosed"})
            raise AssertionError("an invalid regex was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "regex" in str(e), e

    @test
    def stop_sequence():
        r = client.chat.completions.create(model=NAME, messages=QUESTION, temperature=0, stop=["of Fr"])
        assert r.choices[0].message.content == "The capital ", r.choices[0].message.content

    @test
    def cached_tokens_on_a_repeated_prefix():
        long = [{"role": "system", "content": "You are a careful assistant. " * 20}] + QUESTION
        client.chat.completions.create(model=NAME, messages=long, temperature=0, max_tokens=2)
        r = client.chat.completions.create(model=NAME, messages=long, temperature=0, max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens >= 16 * (r.usage.prompt_tokens // 16 - 1), r.usage

    @test
    def bad_requests_are_400_with_the_parameter():
        try:
            client.chat.completions.create(model=NAME, messages=QUESTION, temperature=7)
            raise AssertionError("temperature 7 accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "temperature" in str(e)
        try:
            client.chat.completions.create(model=NAME, messages=[], max_tokens=4)
            raise AssertionError("empty messages accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400

    @test
    def wrong_key_is_401():
        bad = openai.OpenAI(base_url=keyed_url, api_key="wrong", max_retries=0)
        try:
            bad.models.list()
            raise AssertionError("wrong key accepted")
        except openai.AuthenticationError as e:
            assert e.status_code == 401
        good = openai.OpenAI(base_url=keyed_url, api_key="sekrit", max_retries=0)
        assert [m.id for m in good.models.list().data] == [NAME]

    @test
    def responses_greedy():
        r = client.responses.create(model=NAME, input=QUESTION, temperature=0, max_output_tokens=32,
                                    metadata={"k": "v"})
        assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed", r
        assert r.output_text == PARIS, r.output_text
        assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
        assert r.usage.input_tokens == 37 and r.usage.output_tokens > 0
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        assert r.usage.output_tokens_details.reasoning_tokens == 0
        assert r.metadata == {"k": "v"} and r.store is False
        cut = client.responses.create(model=NAME, input="What is the capital of France?", temperature=0,
                                      max_output_tokens=2)
        assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens", cut

    @test
    def responses_streaming():
        events = list(client.responses.create(model=NAME, input=QUESTION, temperature=0, stream=True))
        types = [e.type for e in events]
        assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"], types
        assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"], types
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == PARIS and events[-1].response.output_text == PARIS, text
        # The SDK's own accumulator agrees.
        with client.responses.stream(model=NAME, input=QUESTION, temperature=0) as stream:
            deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            final = stream.get_final_response()
        assert deltas == PARIS and final.output_text == PARIS and final.status == "completed"

    @test
    def responses_function_tool_round_trip():
        ask = weather_questions()
        r = client.responses.create(model=NAME, input=ask, tools=[WEATHER_TOOL], temperature=0, max_output_tokens=40)
        calls = [item for item in r.output if item.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather", r.output
        assert json.loads(calls[0].arguments) == {"city": "Paris"}, calls[0].arguments
        # The output items go back as input, with the function's result.
        follow = ask + r.output + [{"type": "function_call_output", "call_id": calls[0].call_id,
                                    "output": json.dumps({"temperature_c": 18, "sky": "sunny"})}]
        done = client.responses.create(model=NAME, input=follow, tools=[WEATHER_TOOL], temperature=0,
                                       max_output_tokens=40)
        assert done.status in ("completed", "incomplete") and done.output, done
        assert all(item.type in ("message", "function_call") for item in done.output), done.output
        assert done.usage.input_tokens > r.usage.input_tokens
        # Streamed, the call arrives as its argument events.
        events = list(client.responses.create(model=NAME, input=ask, tools=[WEATHER_TOOL], temperature=0,
                                              max_output_tokens=40, stream=True))
        args = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(args) == 1 and json.loads(args[0].arguments) == {"city": "Paris"}, [e.type for e in events]

    @test
    def chat_tool_round_trip():
        tool = {"type": "function", "function": {k: WEATHER_TOOL[k] for k in ("name", "description", "parameters")}}
        ask = weather_questions()
        r = client.chat.completions.create(model=NAME, messages=ask, tools=[tool], temperature=0, max_tokens=40)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", r
        assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name == "get_weather", msg
        assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}, msg.tool_calls[0]
        call = msg.tool_calls[0]
        # The call and its result go back; the model answers (or calls again) in a well-formed turn.
        follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}]
        done = client.chat.completions.create(model=NAME, messages=follow, tools=[tool], temperature=0, max_tokens=40)
        assert done.choices[0].finish_reason in ("stop", "length", "tool_calls"), done
        assert done.usage.prompt_tokens > r.usage.prompt_tokens
        # Streamed, the call arrives as tool_call deltas whose arguments concatenate to the same call.
        chunks = list(client.chat.completions.create(model=NAME, messages=ask, tools=[tool], temperature=0,
                                                     max_tokens=40, stream=True))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert deltas and deltas[0].function.name == "get_weather", deltas
        args = "".join(d.function.arguments or "" for d in deltas)
        assert json.loads(args) == {"city": "Paris"}, args
        assert chunks[-1].choices[0].finish_reason == "tool_calls" or any(
            c.choices and c.choices[0].finish_reason == "tool_calls" for c in chunks)

    @test
    def forced_tool_choice_is_a_valid_call():
        params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                  "required": ["city"], "additionalProperties": False}
        tool = {"type": "function", "function": {"name": "get_weather", "description": WEATHER_TOOL["description"],
                                                 "parameters": params}}
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            r = client.chat.completions.create(model=NAME, messages=QUESTION, tools=[tool], tool_choice=choice,
                                               temperature=0, max_tokens=64)
            calls = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1, r
            assert calls[0].function.name == "get_weather"
            assert isinstance(json.loads(calls[0].function.arguments)["city"], str), calls[0].function.arguments
        m = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0).messages.create(
            model=NAME, max_tokens=64, messages=QUESTION, tool_choice={"type": "any"},
            tools=[{"name": "get_weather", "description": WEATHER_TOOL["description"], "input_schema": params}])
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1 and isinstance(uses[0].input["city"], str), m

    @test
    def responses_refuse_state_and_ignore_unknown_parameters():
        for kw, param in ((dict(store=True), "store"), (dict(previous_response_id="resp_1"), "previous_response_id")):
            try:
                client.responses.create(model=NAME, input="Hi", **kw)
                raise AssertionError(f"{param} accepted")
            except openai.BadRequestError as e:
                assert e.status_code == 400 and e.body["param"] == param, e.body
                assert "stateless" in e.body["message"], e.body
        raw = client.responses.with_raw_response.create(model=NAME, input="Hi", max_output_tokens=4,
                                                        extra_body={"frobnicate": 1})
        assert raw.headers.get("x-kiln-ignored-params") == "frobnicate", dict(raw.headers)
        assert raw.parse().status in ("completed", "incomplete")
        strict_client = openai.OpenAI(base_url=strict_url, api_key="unused", max_retries=0)
        try:
            strict_client.responses.create(model=NAME, input="Hi", extra_body={"frobnicate": 1})
            raise AssertionError("--strict-params accepted an unknown field")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body["param"] == "frobnicate", e.body

    def headline(base, seed):
        """The README's request as a new user sends it: no temperature, no max_tokens."""
        c = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        return c.chat.completions.create(model=NAME, messages=QUESTION, seed=seed)

    @model_test
    def defaults_are_llama_cpp_and_unbounded_requests_stop():
        models = client.models.list().model_dump()["data"][0]
        d = models["sampling_defaults"]
        assert (d["temperature"], d["top_k"], d["top_p"], d["min_p"], d["source"]) == (0.8, 40, 0.95, 0.05, "llama.cpp"), d
        assert d["repetition_guard"] == [32, 8], d
        assert models["max_model_len"] == 8192, models
        # Ten seeds at once: each sampled answer ends (end of turn, or the
        # repetition guard on a loop) within the context.
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda seed: headline(url, seed), range(10)))
        for r in answers:
            assert r.choices[0].finish_reason == "stop", r
            assert r.usage.prompt_tokens + r.usage.completion_tokens <= 8192, r.usage

    @model_test
    def headline_request_as_run_sh_serves_it_is_sensible_every_time():
        # scripts/run.sh serves the 135M demo model greedy (`--temperature
        # 0`): its first token is "The" at 15 % and "L" at 14 %, so any
        # sampling temperature answers in broken French a third of the time.
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda seed: headline(greedy_url, seed), range(10)))
        for r in answers:
            assert "Paris" in r.choices[0].message.content, r

    @test
    def llama_cpp_and_client_fields_are_accepted():
        raw = client.chat.completions.with_raw_response.create(
            model=NAME, messages=QUESTION, temperature=0,
            extra_body={"repeat_penalty": 1.0, "cache_prompt": True, "modalities": ["text"],
                        "service_tier": "auto", "n_predict": 5, "mirostat_tau": 5.0})
        r = raw.parse()
        assert r.usage.completion_tokens <= 5 and r.choices[0].finish_reason == "length", r
        assert raw.headers.get("x-kiln-ignored-params") == "mirostat_tau", dict(raw.headers)
        for body, param in (({"modalities": ["text", "audio"]}, "modalities"),
                            ({"audio": {"voice": "alloy", "format": "wav"}}, "audio")):
            try:
                client.chat.completions.create(model=NAME, messages=QUESTION, extra_body=body)
                raise AssertionError(f"{param} accepted")
            except openai.BadRequestError as e:
                assert e.status_code == 400 and e.body["param"] == param, e.body

    @test
    def examples_run_and_answer():
        assert len(EXAMPLES) >= 8, EXAMPLES
        env = dict(os.environ, KILN_URL=url[:-len("/v1")])
        for path in EXAMPLES:
            cmd = ["sh", str(path)] if path.suffix == ".sh" else [sys.executable, str(path)]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
            assert p.returncode == 0, (path.name, p.returncode, p.stdout, p.stderr)
            out = answer_text(json.loads(p.stdout)) if path.suffix == ".sh" else p.stdout
            assert out.strip(), (path.name, p.stdout)

    @test
    def readme_shows_the_examples_unchanged():
        readme = (ROOT / "README.md").read_text()
        shown = {}
        for lang, path in (("python", p) if p.suffix == ".py" else ("sh", p) for p in EXAMPLES):
            block = f"```{lang}\n{path.read_text()}```\n"
            assert block in readme, f"README.md does not show {path.relative_to(ROOT)} byte for byte"
            shown[path.read_text()] = path
        library = ROOT / "crates" / "kiln-engine" / "examples" / "chat.rs"
        assert f"```rust\n{library.read_text()}```\n" in readme, "README.md does not show the library example"
        # And every README block that reads KILN_URL is one of the files.
        for body in re.findall(r"^```(?:sh|python)\n(.*?)^```$", readme, re.S | re.M):
            assert "KILN_URL" not in body or body in shown, "a README example is not in examples/: " + body[:80]

    claude = anthropic.Anthropic(base_url=url[:-len("/v1")], api_key="unused", max_retries=0)

    @test
    def anthropic_messages_greedy_and_streaming():
        r = claude.messages.create(model=NAME, max_tokens=32, messages=QUESTION, extra_body=GREEDY)
        assert r.content[0].text == "The capital of France is Paris.", r
        assert r.stop_reason == "end_turn" and r.usage.input_tokens > 0
        with claude.messages.stream(model=NAME, max_tokens=32, messages=QUESTION, extra_body=GREEDY) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == r.content[0].text and final.stop_reason == "end_turn"

    @test
    def anthropic_count_tokens_and_tool_error():
        n = claude.messages.count_tokens(model=NAME, messages=QUESTION).input_tokens
        r = claude.messages.create(model=NAME, max_tokens=4, messages=QUESTION, extra_body=GREEDY)
        assert n == r.usage.input_tokens, (n, r.usage)
        convo = QUESTION + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "France"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "timeout", "is_error": True}]},
        ]
        r = claude.messages.create(model=NAME, max_tokens=8, messages=convo, extra_body=GREEDY)
        assert r.stop_reason in ("end_turn", "max_tokens")

    @test
    def anthropic_errors_are_typed():
        try:
            claude.messages.create(model=NAME, max_tokens=0, messages=QUESTION)
            raise AssertionError("max_tokens 0 accepted")
        except anthropic.BadRequestError as e:
            assert e.status_code == 400 and e.body["type"] == "error"

    passed = failed = 0
    try:
        for t in tests:
            try:
                started = time.monotonic()
                t()
                print(f"test sdk::{SDKS}::{t.__name__} ... ok ({time.monotonic() - started:.1f} s)")
                passed += 1
            except Exception:
                print(f"test sdk::{SDKS}::{t.__name__} ... FAILED")
                traceback.print_exc()
                failed += 1
    finally:
        for p in (server, keyed, strict, greedy):
            p.terminate()
            p.wait(timeout=60)
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed; 0 ignored")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
