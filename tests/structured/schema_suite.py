#!/usr/bin/env python3
"""Structured output against an independent validator: `kiln serve` on each given
model (SmolLM2 and Qwen2.5-Coder in the test run) answers 30 JSON schemas
(tests/structured/schemas.py) with `response_format: json_schema`, all requests at
once; every answer must parse and validate with Python `jsonschema` (Draft 2020-12,
formats checked). Prints one `test result:` line in cargo's format.

    python3 tests/structured/schema_suite.py KILN_BINARY MODEL [MODEL...]
"""
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jsonschema

sys.path.insert(0, os.path.dirname(__file__))
from schemas import OTHER_FORMATS, SCHEMAS  # noqa: E402

KILN, MODELS = sys.argv[1], sys.argv[2:]


def start(model):
    p = subprocess.Popen([KILN, "serve", model, "--port", "0", "--threads", "2", "--device", "cpu"],
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    base = None
    while time.time() < deadline and base is None:
        m = re.search(r"on (http://[0-9.:]+)", p.stderr.readline() or "")
        if m:
            base = m.group(1)
        if p.poll() is not None:
            raise RuntimeError("kiln serve exited")
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                return p, base
        except Exception:
            time.sleep(0.5)
    p.kill()
    raise RuntimeError("kiln serve did not get ready")


def ask(base, name, i, schema):
    body = {"model": name, "temperature": 0, "max_tokens": 400,
            "messages": [{"role": "user", "content": "Reply with a JSON value that fits this schema: "
                          + json.dumps(schema)}],
            "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return {"http_error": e.code, "body": e.read().decode(errors="replace")}


def ask_other(base, name, field, value):
    body = {"model": name, "temperature": 0, "max_tokens": 60, field: value,
            "messages": [{"role": "user", "content": "Answer briefly: what is the capital of France?"}]}
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.load(r)["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as e:
        return "HTTP %d %s" % (e.code, e.read().decode(errors="replace"))


def main():
    passed = failed = 0
    for model in MODELS:
        p, base = start(model)
        name = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
        try:
            with concurrent.futures.ThreadPoolExecutor(len(SCHEMAS)) as pool:
                answers = list(pool.map(lambda a: ask(base, name, *a), enumerate(SCHEMAS)))
            with concurrent.futures.ThreadPoolExecutor(len(OTHER_FORMATS)) as pool:
                others = list(pool.map(lambda f: ask_other(base, name, f[0], f[1]), OTHER_FORMATS))
            for i, ((field, _, check), text) in enumerate(zip(OTHER_FORMATS, others)):
                ok = bool(check(text))
                passed, failed = passed + ok, failed + (not ok)
                print(f"test structured::{os.path.basename(model)}::{field}_{i} ... {'ok' if ok else 'FAILED: ' + repr(text)[:200]}")
            # A schema feature llguidance does not implement is a 400 with the reason.
            refused = ask(base, name, 99, {"type": "array", "items": {"type": "integer"}, "uniqueItems": True})
            err = json.loads(refused.get("body", "{}")).get("error", {})
            ok = refused.get("http_error") == 400 and err.get("param") == "response_format" \
                and "uniqueItems" in err.get("message", "")
            passed, failed = passed + ok, failed + (not ok)
            print(f"test structured::{os.path.basename(model)}::unsupported_schema_is_400 ... {'ok' if ok else 'FAILED: ' + str(refused)[:300]}")
        finally:
            p.terminate()
            p.wait(timeout=30)
        for i, (schema, r) in enumerate(zip(SCHEMAS, answers)):
            text = r["choices"][0]["message"]["content"] if "choices" in r else json.dumps(r)
            try:
                value = json.loads(text)
                jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator,
                                    format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
                passed += 1
                print(f"test structured::{os.path.basename(model)}::schema_{i} ... ok")
            except Exception as e:
                failed += 1
                print(f"test structured::{os.path.basename(model)}::schema_{i} ... FAILED: {e!r:.300} in {text[:200]!r}")
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed; 0 ignored")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
