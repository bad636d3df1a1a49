#!/usr/bin/env python3
"""Goldens for Gemma-3-270M prompts longer than its 512-token sliding window.

transformers on CPU in float32 (eager attention) runs the real GGUF, whose
weights it dequantizes to float32 through the `gguf` package, as the shipped
goldens in ../gemma3-270m were made. For each prompt it stores:

* `ids`: the prompt as `tok.encode(text)` (BOS 2 first);
* `logprobs_npy`: log-softmax (float64, stored float32) of the last
  position's logits from one no-cache forward pass over the prompt;
* `top20`: the 20 best ids there;
* `generated_ids`: `model.generate(do_sample=False, max_new_tokens=N)`
  with the default cache, then checked against one no-cache forward pass
  over prompt + generated ids (every generated token must be that pass's
  argmax), with each step's top-2 margin.

Usage: PYTHONPATH=<torch+transformers dir> python3 make_goldens.py \
           --gguf models/gemma-3-270m-q4_k_m.gguf --out testdata/goldens/gemma3-270m-long
"""
import argparse, hashlib, json, time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_grad_enabled(False)
torch.set_num_threads(2)

ap = argparse.ArgumentParser()
ap.add_argument("--gguf", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--max-new-tokens", type=int, default=24)
args = ap.parse_args()
out = Path(args.out)
(out / "logits_npy").mkdir(parents=True, exist_ok=True)
gguf = Path(args.gguf).resolve()

t0 = time.time()
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
model = AutoModelForCausalLM.from_pretrained(
    str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager"
)
model.eval()
print(f"loaded in {time.time() - t0:.0f}s", flush=True)

# Deterministic long prompts. Each states a fact early (further back than the
# sliding window by the end, so only the full-attention layers can see it)
# and asks for it last.
colors = ["red", "green", "blue", "yellow", "purple", "orange", "silver", "black"]
towns = ["Aldham", "Brixby", "Corwen", "Dunmore", "Elstow", "Farley", "Gresham", "Holt"]
def ledger(n, seed):
    lines = []
    for i in range(n):
        t, c = towns[(i * 3 + seed) % 8], colors[(i * 5 + seed) % 8]
        lines.append(
            f"Entry {i + 1}: the courier from {t} delivered {(i * 7 + seed) % 50 + 3} "
            f"{c} crates to the warehouse on day {(i * 11 + seed) % 28 + 1}."
        )
    return "\n".join(lines)

prompts = [
    ("ledger_password",
     "The secret password is TANGERINE-42. Remember it.\n\n" + ledger(24, 1)
     + "\n\nQuestion: What is the secret password?\nAnswer: The secret password is"),
    ("ledger_summary",
     "Notes from the harbour office.\n" + ledger(38, 5)
     + "\n\nSummary of the notes above: the courier from"),
    ("lighthouse_story",
     "Once upon a time, in a village by the sea, there lived an old lighthouse keeper named Tobias. "
     * 1 + " ".join(
         f"On the {d} morning he climbed the {s} steps, polished the lens, and counted {b} boats."
         for d, s, b in zip(
             ["first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth",
              "ninth", "tenth", "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth",
              "sixteenth", "seventeenth", "eighteenth", "nineteenth", "twentieth"] * 2,
             [str(100 + 7 * i) for i in range(40)],
             [str(3 + (i * 13) % 17) for i in range(40)],
         ))
     + " One evening, a stranger knocked on the door and said"),
]

def forward(ids):
    return model(torch.tensor([ids]), use_cache=False).logits[0]

cases = []
for name, text in prompts:
    ids = tok.encode(text)
    assert ids[0] == 2 and len(ids) > 512, (name, len(ids))
    t = time.time()
    last = forward(ids)[-1].double()
    lp = torch.log_softmax(last, -1).float().numpy()
    np.save(out / "logits_npy" / f"{name}.logprobs.npy", lp.astype("<f4"))
    top = torch.topk(last, 20)
    gen = model.generate(
        torch.tensor([ids]), do_sample=False, num_beams=1,
        max_new_tokens=args.max_new_tokens, eos_token_id=1,
    )[0, len(ids):].tolist()
    full = forward(ids + gen)
    steps = []
    for i, g in enumerate(gen):
        row = full[len(ids) - 1 + i]
        v, k = torch.topk(row, 2)
        steps.append({"top1": int(k[0]), "top2": int(k[1]),
                      "margin": float(v[0] - v[1]), "matches_generated": int(k[0]) == g})
    assert all(s["matches_generated"] for s in steps), name
    cases.append({
        "name": name, "text": text, "ids": ids, "n_tokens": len(ids),
        "logprobs_npy": f"logits_npy/{name}.logprobs.npy",
        "top20": [{"id": int(i), "logit": float(v)} for v, i in zip(top.values, top.indices)],
        "generated_ids": gen,
        "generated_text": tok.decode(gen),
        "steps_teacher_forced_no_cache": steps,
        "min_top2_margin": min(s["margin"] for s in steps),
    })
    print(f"{name}: {len(ids)} tokens, {time.time() - t:.0f}s, "
          f"min margin {cases[-1]['min_top2_margin']:.4f}: {tok.decode(gen)!r}", flush=True)

sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
(out / "cases.json").write_text(json.dumps({
    "source": {"gguf_file": gguf.name, "gguf_sha256": sha,
               "transformers": transformers.__version__, "torch": torch.__version__,
               "dtype": "float32", "attn_implementation": "eager",
               "sliding_window": model.config.sliding_window},
    "cases": cases,
}, indent=1, ensure_ascii=False))
