#!/usr/bin/env python3
"""Kiln's server driven by the official OpenAI and Anthropic Python SDKs
(installed from PyPI by scripts/test.sh): `kiln serve` on SmolLM2 on a free
loopback port, then chat (plain and streaming), completions, logprobs, seeds,
stop sequences, cached tokens on a repeated prefix, Anthropic messages (plain,
streaming, count_tokens, a tool result with is_error), and errors as each SDK
sees them.

    python3 tests/sdk/sdk_conformance.py KILN_BINARY MODEL.gguf

Prints one `test result:` line in cargo's format so scripts/test.sh counts it.
"""
import re
import subprocess
import sys
import time
import traceback

import anthropic
import openai

KILN, MODEL = sys.argv[1], sys.argv[2]
NAME = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def start_server(*extra):
    p = subprocess.Popen([KILN, "serve", MODEL, "--port", "0", "--threads", "2", "--device", "cpu", *extra],
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        line = p.stderr.readline()
        m = re.search(r"on (http://[0-9.:]+)", line or "")
        if m:
            return p, m.group(1) + "/v1"
        if p.poll() is not None:
            raise RuntimeError("kiln serve exited: " + p.stderr.read())
    p.kill()
    raise RuntimeError("kiln serve did not start in time")


def main():
    server, url = start_server()
    keyed, keyed_url = start_server("--api-key", "sekrit")
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    tests = []

    def test(f):
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

    claude = anthropic.Anthropic(base_url=url[:-len("/v1")], api_key="unused", max_retries=0)

    @test
    def anthropic_messages_greedy_and_streaming():
        r = claude.messages.create(model=NAME, max_tokens=32, temperature=0, messages=QUESTION)
        assert r.content[0].text == "The capital of France is Paris.", r
        assert r.stop_reason == "end_turn" and r.usage.input_tokens > 0
        with claude.messages.stream(model=NAME, max_tokens=32, temperature=0, messages=QUESTION) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert text == r.content[0].text and final.stop_reason == "end_turn"

    @test
    def anthropic_count_tokens_and_tool_error():
        n = claude.messages.count_tokens(model=NAME, messages=QUESTION).input_tokens
        r = claude.messages.create(model=NAME, max_tokens=4, temperature=0, messages=QUESTION)
        assert n == r.usage.input_tokens, (n, r.usage)
        convo = QUESTION + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "France"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "timeout", "is_error": True}]},
        ]
        r = claude.messages.create(model=NAME, max_tokens=8, temperature=0, messages=convo)
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
                t()
                print(f"test sdk::{t.__name__} ... ok")
                passed += 1
            except Exception:
                print(f"test sdk::{t.__name__} ... FAILED")
                traceback.print_exc()
                failed += 1
    finally:
        for p in (server, keyed):
            p.terminate()
            p.wait(timeout=60)
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed; 0 ignored")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
