#!/usr/bin/env python3
"""Embedding throughput on the CPU: Kiln's `/v1/embeddings` (one server, 2
threads) against sentence-transformers (torch, 2 threads) on the same texts
and model, alternated in one run; sequences per second and tokens per
second, both engines' vectors compared (cosine). Writes a JSON file under
bench/results/.

    python3 bench/embeddings_vs_st.py KILN_BINARY MODEL_DIR [ROUNDS]

Needs sentence-transformers in the Python it runs under (the golden-making
venv: `python3 -m venv V && V/bin/pip install sentence-transformers`) and
the openai-free stdlib only for HTTP.
"""
import json
import math
import os
import pathlib
import platform
import re
import subprocess
import sys
import time
import urllib.request

import torch
from sentence_transformers import SentenceTransformer

KILN, MODEL = sys.argv[1], pathlib.Path(sys.argv[2])
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 32

WORDS = ("the quick brown fox jumps over a lazy dog while search engines map text to vectors so that "
         "similar meanings land close together and questions find passages that answer them").split()


def texts(n):
    """n sentences of 8 to 40 words, fixed by a simple generator."""
    out, s = [], 12345
    for _ in range(n):
        s = (s * 1103515245 + 12345) % (1 << 31)
        k = 8 + s % 33
        out.append(" ".join(WORDS[(s >> (3 + i)) % len(WORDS)] for i in range(k)) + ".")
    return out


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def start():
    p = subprocess.Popen([KILN, "--threads", "2", "serve", str(MODEL), "--port", "0", "--device", "cpu"],
                         stderr=subprocess.PIPE, text=True)
    while True:
        line = p.stderr.readline()
        m = re.search(r"on (http://[0-9.:]+)", line or "")
        if m:
            base = m.group(1)
            break
        if p.poll() is not None:
            raise RuntimeError(p.stderr.read())
    for _ in range(600):
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return p, base
        except Exception:
            time.sleep(0.1)
    raise RuntimeError("kiln serve did not get ready")


def kiln_run(base, data):
    t = time.perf_counter()
    vecs, tokens = [], 0
    for i in range(0, len(data), BATCH):
        r = post(base + "/v1/embeddings", {"input": data[i:i + BATCH]})
        vecs += [d["embedding"] for d in r["data"]]
        tokens += r["usage"]["prompt_tokens"]
    return time.perf_counter() - t, vecs, tokens


def st_run(m, data):
    t = time.perf_counter()
    v = m.encode(data, batch_size=BATCH, convert_to_numpy=True)
    return time.perf_counter() - t, v


def main():
    torch.set_num_threads(2)
    data = texts(512)
    m = SentenceTransformer(str(MODEL), device="cpu")
    server, base = start()
    try:
        kiln_run(base, data[:64])
        st_run(m, data[:64])
        rows = []
        for _ in range(ROUNDS):
            kt, kv, tokens = kiln_run(base, data)
            sts, sv = st_run(m, data)
            rows.append({"kiln_seconds": kt, "st_seconds": sts})
        worst = min(sum(a * b for a, b in zip(x, y)) / math.sqrt(sum(a * a for a in x) * sum(b * b for b in y))
                    for x, y in zip(kv, sv.tolist()))
    finally:
        server.terminate()
        server.wait(timeout=60)
    kt = sorted(r["kiln_seconds"] for r in rows)[len(rows) // 2]
    sts = sorted(r["st_seconds"] for r in rows)[len(rows) // 2]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    report = {
        "what": f"{MODEL.name}: {len(data)} sentences (8-40 words, {tokens} tokens with special tokens) embedded in "
                f"batches of {BATCH}: Kiln through POST /v1/embeddings (kiln serve, 2 threads, one client) vs "
                "sentence-transformers encode() (torch, 2 threads), alternated; medians of the rounds",
        "commit": commit, "machine": platform.node(), "cpu": cpu,
        "versions": {"torch": torch.__version__, "sentence_transformers": __import__("sentence_transformers").__version__},
        "rounds": rows,
        "kiln_sequences_per_second": len(data) / kt, "st_sequences_per_second": len(data) / sts,
        "kiln_tokens_per_second": tokens / kt, "st_tokens_per_second": tokens / sts,
        "ratio_kiln_over_st": sts / kt, "worst_cosine_kiln_vs_st": worst,
    }
    out = ROOT / "bench/results" / f"{time.strftime('%Y-%m-%d')}_embeddings-vs-st_{platform.node()}_{commit}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"kiln {report['kiln_sequences_per_second']:.0f} seq/s, sentence-transformers "
          f"{report['st_sequences_per_second']:.0f} seq/s, ratio {report['ratio_kiln_over_st']:.2f}; "
          f"worst cosine {worst:.6f}; wrote {out}")


if __name__ == "__main__":
    main()
