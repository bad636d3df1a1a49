#!/usr/bin/env python3
"""Sanity-check a goldens directory against a reference one (same cases, same JSON schema).

Run after gen_goldens.py and export_and_verify.py, from the repo root (needs numpy: use the same PYTHONPATH):
  PYTHONPATH=/root/.cache/kiln/torchonly:/root/.cache/kiln/pytorch python3 scripts/goldens/qwen15/check_goldens.py testdata/goldens/qwen2.5-coder-1.5b testdata/goldens/qwen2.5-coder-0.5b
Checks: every JSON parses; key sets (top level, per case, per nested dict / list element) equal the reference's;
the case inputs (tokenizer strings, conversations, logits prompts, greedy messages, max_new_tokens) are the same;
every generated greedy token equals the teacher-forced argmax; each .npy is float32 [vocab_size]; the logits .npy
top-20 agrees with the JSON. Prints differences and exits 1 if any input/verification check fails
(schema differences are only reported).
"""
import json, sys
from pathlib import Path
import numpy as np

new, ref = Path(sys.argv[1]), Path(sys.argv[2])
FILES = ["tokenizer_cases.json", "chat_template_cases.json", "logits_cases.json", "greedy_cases.json",
         "model_meta.json", "verify_report.json"]
schema_diffs, errors = [], []

def keys_walk(a, b, path):
    if isinstance(a, dict) and isinstance(b, dict):
        ka, kb = set(a), set(b)
        if ka != kb:
            schema_diffs.append(f"{path}: only new {sorted(ka - kb)} only ref {sorted(kb - ka)}")
        for k in ka & kb:
            keys_walk(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        if a and b:
            keys_walk(a[0], b[0], f"{path}[0]")
    elif type(a) != type(b) and not (a is None or b is None) and not ({type(a), type(b)} <= {int, float}):
        schema_diffs.append(f"{path}: type new {type(a).__name__} ref {type(b).__name__}")

J = {}
for f in FILES:
    a = json.loads((new / f).read_text()); b = json.loads((ref / f).read_text())
    J[f] = a
    keys_walk(a, b, f)
    if isinstance(a.get("cases"), list):
        if len(a["cases"]) != len(b["cases"]):
            errors.append(f"{f}: {len(a['cases'])} cases vs {len(b['cases'])}")
        for i, (x, y) in enumerate(zip(a["cases"], b["cases"])):
            keys_walk(x, y, f"{f}.cases[{i}]")
            for k in ("text", "messages", "name"):
                if k in y and x.get(k) != y[k] and not (f == "logits_cases.json" and k == "text"):
                    errors.append(f"{f}.cases[{i}].{k} differs")
            if f == "logits_cases.json" and x["name"] != "raw_bos_only" and x["text"] != y["text"]:
                errors.append(f"{f}.cases[{i}].text differs")
            if f in ("tokenizer_cases.json", "chat_template_cases.json", "logits_cases.json") and x.get("ids") != y.get("ids"):
                print(f"note: {f}.cases[{i}] ids differ from reference (expected equal for the same tokenizer)")

g = J["greedy_cases.json"]
gref = json.loads((ref / "greedy_cases.json").read_text())
if g["settings"]["max_new_tokens"] != gref["settings"]["max_new_tokens"]:
    errors.append("max_new_tokens differs")
for i, c in enumerate(g["cases"]):
    st = c["steps_teacher_forced_no_cache"]
    if len(st) != len(c["generated_ids"]) or any(s["top1"] != t for s, t in zip(st, c["generated_ids"])):
        errors.append(f"greedy case {i}: generated != teacher-forced argmax")
    if not c["all_steps_match_no_cache_argmax"]:
        errors.append(f"greedy case {i}: all_steps_match_no_cache_argmax false")
    print(f"greedy[{i}] prompt {len(c['prompt_ids'])} gen {len(c['generated_ids'])} eos {c['stopped_on_eos']} "
          f"min_margin {c['min_top2_margin']} {c['seconds']}s {c['generated_text']!r}")

vocab = J["model_meta.json"]["config"]["vocab_size"]
for c in J["logits_cases.json"]["cases"]:
    for key in ("logits_npy", "logprobs_npy"):
        p = new / c[key]
        if not p.exists():
            errors.append(f"missing {p}"); continue
        arr = np.load(p)
        if arr.dtype != np.float32 or arr.shape != (vocab,):
            errors.append(f"{p}: {arr.dtype} {arr.shape}, want float32 ({vocab},)")
        if key == "logits_npy":
            top = [t["id"] for t in c["top20"]]
            if int(arr.argmax()) != top[0] or abs(float(arr[top[0]]) - c["top20"][0]["logit"]) > 0:
                errors.append(f"{p}: argmax/logit disagree with top20")
        else:
            s = float(np.exp(arr.astype(np.float64)).sum())
            if abs(s - 1) > 1e-4:
                errors.append(f"{p}: exp sum {s}")
vr = J["verify_report.json"]
if not vr["greedy_all_match"] or vr["tokenizer_mismatches_vs_golden"] or any(d["max_abs_diff_logits"] != 0.0 or not d["argmax_same"] for d in vr["logits_vs_golden"]):
    errors.append("verify_report not clean")
print("vocab", vocab, "tokenizer roundtrip_exact:", sum(c["roundtrip_exact"] for c in J["tokenizer_cases.json"]["cases"]), "/", len(J["tokenizer_cases.json"]["cases"]))
print("schema differences vs reference:", schema_diffs or "none")
print("errors:", errors or "none")
sys.exit(1 if errors else 0)
