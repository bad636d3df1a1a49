#!/usr/bin/env python3
"""`POST /v1/embeddings` through the official OpenAI Python SDK, unchanged:
`kiln serve` on all-MiniLM-L6-v2 and on EmbeddingGemma-300M (with
`--matryoshka-dimensions`), `client.embeddings.create` with its default
(base64, which the SDK decodes) and with floats, strings, token ids,
`dimensions` (cut and renormalized), a task prompt, truncation past the
limit, and the errors a client gets. Vectors are checked against the
sentence-transformers goldens in testdata/goldens/embeddings.

    python3 tests/sdk/embeddings_sdk.py KILN_BINARY MODELS_DIR

Prints one `test result:` line in cargo's format so scripts/test.sh counts it.
"""
import json
import math
import pathlib
import sys
import time
import traceback

import openai

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sdk_conformance import wait_ready  # noqa: E402

KILN, MODELS = sys.argv[1], pathlib.Path(sys.argv[2])
ROOT = pathlib.Path(__file__).resolve().parents[2]
SDK = f"openai-{openai.__version__}"


def golden(name):
    g = json.loads((ROOT / "testdata/goldens/embeddings" / f"{name}.json").read_text())
    return {c["name"]: c for c in g["cases"]}


def start(model_dir, *extra):
    import re
    import subprocess
    p = subprocess.Popen([KILN, "serve", str(model_dir), "--port", "0", "--threads", "2", "--device", "cpu", *extra],
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        line = p.stderr.readline()
        m = re.search(r"on (http://[0-9.:]+)", line or "")
        if m:
            wait_ready(p, m.group(1), deadline)
            return p, m.group(1) + "/v1"
        if p.poll() is not None:
            raise RuntimeError("kiln serve exited: " + p.stderr.read())
    p.kill()
    raise RuntimeError("kiln serve did not start in time")


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def unit(v):
    n = math.sqrt(sum(x * x for x in v))
    return [x / n for x in v]


def main():
    minilm, minilm_url = start(MODELS / "all-MiniLM-L6-v2")
    gemma, gemma_url = start(MODELS / "embeddinggemma-300m", "--matryoshka-dimensions", "512,256,128")
    mini = openai.OpenAI(base_url=minilm_url, api_key="unused", max_retries=0)
    eg = openai.OpenAI(base_url=gemma_url, api_key="unused", max_retries=0)
    gm, gg = golden("all-MiniLM-L6-v2"), golden("embeddinggemma-300m")
    names = ["hello", "fox", "german", "japanese", "emoji", "code"]
    tests = []

    def test(f):
        tests.append(f)
        return f

    @test
    def default_base64_decoded_by_the_sdk():
        r = mini.embeddings.create(model="all-MiniLM-L6-v2", input=[gm[n]["text"] for n in names])
        assert [d.index for d in r.data] == list(range(len(names)))
        for d, n in zip(r.data, names):
            assert len(d.embedding) == 384
            assert cosine(d.embedding, gm[n]["embedding"]) >= 0.9999, n
        assert r.usage.prompt_tokens == sum(len(gm[n]["input_ids"]) for n in names)
        assert r.usage.total_tokens == r.usage.prompt_tokens and r.model == "all-MiniLM-L6-v2"

    @test
    def floats_and_one_string():
        r = mini.embeddings.create(model="all-MiniLM-L6-v2", input=gm["question"]["text"], encoding_format="float")
        assert len(r.data) == 1 and cosine(r.data[0].embedding, gm["question"]["embedding"]) >= 0.9999

    @test
    def token_ids_are_embedded_as_given():
        ids = gm["fox"]["input_ids"]
        r = mini.embeddings.create(model="all-MiniLM-L6-v2", input=[ids, ids[:5]], encoding_format="float")
        assert cosine(r.data[0].embedding, gm["fox"]["embedding"]) >= 0.9999
        assert r.usage.prompt_tokens == len(ids) + 5

    @test
    def past_the_limit_is_refused_unless_truncated():
        text = gm["past_the_limit"]["text"]
        try:
            mini.embeddings.create(model="all-MiniLM-L6-v2", input=["short", text])
            raise AssertionError("an input past the limit was accepted")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "256" in str(e) and "input[1]" in str(e), e
        r = mini.embeddings.create(model="all-MiniLM-L6-v2", input=text, extra_body={"truncate": True})
        assert cosine(r.data[0].embedding, gm["past_the_limit"]["embedding"]) >= 0.9999

    @test
    def dimensions_need_a_matryoshka_model():
        try:
            mini.embeddings.create(model="all-MiniLM-L6-v2", input="x", dimensions=128)
            raise AssertionError("dimensions accepted for a model that declares none")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "Matryoshka" in str(e), e

    @test
    def generation_on_an_embedding_model_is_refused():
        try:
            mini.chat.completions.create(model="all-MiniLM-L6-v2", messages=[{"role": "user", "content": "hi"}])
            raise AssertionError("chat accepted")
        except openai.BadRequestError as e:
            assert "/v1/embeddings" in str(e), e

    @test
    def bad_inputs_are_refused_by_name():
        for bad, field in [([], "input"), ({"a": 1}, "input")]:
            try:
                mini.embeddings.create(model="all-MiniLM-L6-v2", input=bad)
                raise AssertionError(f"{bad!r} accepted")
            except openai.BadRequestError as e:
                assert e.body["param"] == field, e.body
        try:
            mini.embeddings.create(model="all-MiniLM-L6-v2", input="x", encoding_format="int8")
            raise AssertionError("int8 accepted")
        except openai.BadRequestError as e:
            assert e.body["param"] == "encoding_format", e.body

    @test
    def embeddinggemma_prompts_and_matryoshka():
        q = gg["query_prompt"]
        r = eg.embeddings.create(model="embeddinggemma-300m", input=q["text"], extra_body={"prompt_name": "query"})
        assert len(r.data[0].embedding) == 768
        assert cosine(r.data[0].embedding, q["embedding"]) >= 0.9999
        for d in (256, 128):
            r = eg.embeddings.create(model="embeddinggemma-300m", input=q["text"], dimensions=d,
                                     extra_body={"prompt_name": "query"})
            v = r.data[0].embedding
            assert len(v) == d and abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5
            assert cosine(v, unit(q["embedding"][:d])) >= 0.9999
        try:
            eg.embeddings.create(model="embeddinggemma-300m", input="x", dimensions=300)
            raise AssertionError("300 accepted")
        except openai.BadRequestError as e:
            assert "512, 256, 128" in str(e), e

    passed = failed = 0
    try:
        for t in tests:
            try:
                started = time.monotonic()
                t()
                print(f"test sdk::{SDK}::embeddings::{t.__name__} ... ok ({time.monotonic() - started:.1f} s)")
                passed += 1
            except Exception:
                print(f"test sdk::{SDK}::embeddings::{t.__name__} ... FAILED")
                traceback.print_exc()
                failed += 1
    finally:
        for p in (minilm, gemma):
            p.terminate()
            p.wait(timeout=60)
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed; 0 ignored")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
