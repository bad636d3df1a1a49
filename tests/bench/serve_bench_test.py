#!/usr/bin/env python3
"""bench/serve_bench.py against a real `kiln serve` (SmolLM2 on the CPU): closed-loop levels,
an open-loop level with a concurrency cap, ShareGPT-like lengths, and a model the server does
not have. Checks what the benchmark counts — every request completed, exactly the output
tokens asked (`ignore_eos` honoured, counted from the server's usage), the prompt tokens
sent, vLLM's metric names, percentiles in order, a failed request counted with its error —
never how fast anything was.

    python3 tests/bench/serve_bench_test.py KILN_BINARY MODEL

Prints one `test result:` line in cargo's format so scripts/test.sh counts it.
"""
import json
import pathlib
import sys
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests/sdk"))
import kiln_server  # noqa: E402
import serve_bench  # noqa: E402

KILN, MODEL = sys.argv[1], sys.argv[2]
NAMES = ["completed", "failed", "total_input_tokens", "total_output_tokens", "duration",
         "request_throughput", "output_throughput", "total_token_throughput", "max_concurrency",
         "request_rate"] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                            for s in ("mean", "median", "std", "p99")]


def start():
    return kiln_server.start(KILN, MODEL)


def check_level(m, requests, input_tokens, output_tokens):
    for n in NAMES:
        assert n in m, f"{n} missing from {sorted(m)}"
    assert m["completed"] == requests and m["failed"] == 0, m
    assert m["total_output_tokens"] == output_tokens, (m["total_output_tokens"], output_tokens)
    assert m["total_input_tokens"] == input_tokens, (m["total_input_tokens"], input_tokens)
    for x in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < m[f"median_{x}_ms"] <= m[f"p99_{x}_ms"], (x, m)
    # A request's whole latency holds its first token and every gap after it.
    assert m["median_ttft_ms"] < m["median_e2el_ms"], m


def main():
    server, url = start()
    passed = failed = 0
    out = pathlib.Path(tempfile.mkdtemp()) / "bench.json"

    def case(name, f):
        nonlocal passed, failed
        try:
            f()
            passed += 1
            print(f"test {name} ... ok")
        except Exception:
            failed += 1
            print(f"test {name} ... FAILED")
            traceback.print_exc()

    def closed_and_open():
        r = serve_bench.run(["--base-url", url, "--input-len", "24", "--output-len", "12",
                             "--concurrency", "1,3", "--prompts-per-client", "2",
                             "--request-rate", "inf", "--num-prompts", "5", "--max-concurrency", "2",
                             "--out", str(out)])
        c1, c3, o = r["levels"]
        check_level(c1, 2, 2 * 24, 2 * 12)
        check_level(c3, 6, 6 * 24, 6 * 12)
        check_level(o, 5, 5 * 24, 5 * 12)
        assert (c1["max_concurrency"], c3["max_concurrency"], o["max_concurrency"]) == (1, 3, 2)
        saved = json.loads(out.read_text())
        # The closed loop's rate (infinite) is null in the file; the levels are all there.
        assert [m["request_rate"] for m in saved["levels"]] == [None, None, None], saved["levels"]
        assert len(saved["levels"]) == 3

    def sharegpt_like():
        asked = serve_bench.prompts("sharegpt-like", 3, 0, 0, 49152, 3)
        r = serve_bench.run(["--base-url", url, "--dataset", "sharegpt-like", "--seed", "3",
                             "--concurrency", "3", "--prompts-per-client", "1", "--warmup", "0"])
        check_level(r["levels"][0], 3, sum(len(i) for i, _ in asked), sum(o for _, o in asked))
        assert len({len(i) for i, _ in asked}) == 3, "lengths vary"

    def unknown_model_is_counted_as_failed():
        r = serve_bench.run(["--base-url", url, "--model", "no-such-model", "--input-len", "8",
                             "--output-len", "4", "--concurrency", "2", "--prompts-per-client", "1",
                             "--warmup", "0"])
        m = r["levels"][0]
        assert m["completed"] == 0 and m["failed"] == 2, m
        assert any("HTTP 4" in e for e in m["errors"]), m["errors"]

    case("serve_bench_closed_and_open_loops", closed_and_open)
    case("serve_bench_sharegpt_like_lengths", sharegpt_like)
    case("serve_bench_counts_failed_requests", unknown_model_is_counted_as_failed)
    server.terminate()
    server.wait(timeout=30)
    print(f"test result: {'ok' if failed == 0 else 'FAILED'}. {passed} passed; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
