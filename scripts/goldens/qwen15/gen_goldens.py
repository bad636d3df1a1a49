#!/usr/bin/env python3
"""Generate golden reference outputs for a GGUF model using HF transformers (PyTorch, CPU, float32).

Adapted from /work/shared/data/goldens/scripts/gen_goldens.py (which made the qwen2.5-coder-0.5b goldens) to
make testdata/goldens/qwen2.5-coder-1.5b from Qwen2.5-Coder-1.5B-Instruct Q4_K_M. Changes from the original:
a `qwen2` family (the same six ChatML conversations as smollm2 / qwen2.5-coder-0.5b), torch.set_num_threads
(default 2), `dtype=` instead of the deprecated `torch_dtype=`, and the sha256 is computed before the
(~7 GB f32) model load. Everything else (cases, JSON schema, greedy settings) is unchanged. Run from the repo root:
  PYTHONPATH=/root/.cache/kiln/torchonly:/root/.cache/kiln/pytorch python3 scripts/goldens/qwen15/gen_goldens.py \
      --gguf models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --out testdata/goldens/qwen2.5-coder-1.5b --family qwen2
then export_and_verify.py (same directory) with --verify-from gguf, then check_goldens.py.
Needs torch 2.15 / transformers 5.24 / gguf 0.19 (see testdata/goldens/VERSIONS.txt); about 8 GB RAM.

Usage: gen_goldens.py --gguf PATH --out DIR [--family smollm2|gemma3|qwen2] [--parts tok,chat,logits,greedy] ...

The GGUF weights are dequantized by transformers (via the `gguf` package) to float32.
All forward passes are done in float32 on CPU, eager attention, no KV-cache tricks.
"""
import argparse, json, os, sys, time, hashlib
from pathlib import Path

import numpy as np
import torch

torch.set_grad_enabled(False)
torch.manual_seed(0)

ap = argparse.ArgumentParser()
ap.add_argument("--gguf", required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--save-safetensors", default=None)
ap.add_argument("--save-dtype", default="float32")
ap.add_argument("--max-new-tokens", type=int, default=48)
ap.add_argument("--family", default="smollm2", choices=["smollm2", "gemma3", "qwen2"])
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--parts", default="tok,chat,logits,greedy")
args = ap.parse_args()
torch.set_num_threads(args.threads)

parts = set(args.parts.split(","))
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)
gguf_path = Path(args.gguf).resolve()

from transformers import AutoModelForCausalLM, AutoTokenizer
import transformers

def sha256(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()

t0 = time.time()
gguf_sha = sha256(gguf_path)
print(f"sha256 {gguf_sha}", flush=True)
tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
model = AutoModelForCausalLM.from_pretrained(
    str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32,
    attn_implementation="eager",
)
model.eval()
print(f"loaded in {time.time()-t0:.1f}s; dtype={next(model.parameters()).dtype}", flush=True)
print(model.config, flush=True)

source = {
    "gguf_file": gguf_path.name,
    "gguf_sha256": gguf_sha,
    "loader": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32, attn_implementation='eager')",
    "tokenizer_loader": "transformers AutoTokenizer.from_pretrained(dir, gguf_file=...)",
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "numpy": np.__version__,
}
try:
    import gguf as _g
    source["gguf_py"] = getattr(_g, "__version__", None) or __import__("importlib.metadata").metadata.version("gguf")
except Exception:
    pass

meta = {
    "source": source,
    "config": model.config.to_dict(),
    "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
    "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
    "pad_token": tok.pad_token, "pad_token_id": tok.pad_token_id,
    "unk_token": tok.unk_token, "unk_token_id": tok.unk_token_id,
    "vocab_size_tokenizer": len(tok),
    "generation_config": model.generation_config.to_dict(),
    "chat_template": tok.chat_template,
    "tokenizer_class": type(tok).__name__,
}
(out / "model_meta.json").write_text(json.dumps(meta, indent=1, ensure_ascii=False, default=str))
if tok.chat_template:
    (out / "chat_template.jinja").write_text(tok.chat_template)

def dump(name, obj):
    (out / name).write_text(json.dumps(obj, indent=1, ensure_ascii=False))
    print("wrote", out / name, flush=True)

# ---------------------------------------------------------------- tokenizer
TOK_STRINGS = [
    "Hello, world!",
    "hello world",
    " Hello",
    "The quick brown fox jumps over the lazy dog.",
    "",
    " ",
    "    four spaces then text",
    "tabs\tand\nnewlines\n\n\nend",
    "trailing spaces   ",
    "\n",
    "1234567890 3.14159 -42 1e-9",
    "I'm can't won't they're you'll we've he'd",
    "CamelCaseIdentifier snake_case_identifier kebab-case",
    "naïve café résumé façade Über straße",
    "Привет, мир! Как дела?",
    "日本語のテキストです。東京タワー",
    "中文测试：你好，世界！",
    "한국어 텍스트 안녕하세요",
    "مرحبا بالعالم",
    "emoji: 😀🚀🦀 👨‍👩‍👧‍👦 🇫🇷",
    "fn main() {\n    println!(\"Hello, {}!\", name);\n}",
    "def f(x):\n\treturn x ** 2  # square\n",
    "<html><body class=\"a\">&amp; &lt;tag&gt;</body></html>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "https://example.com/path?query=1&other=two#frag",
    "<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|>",
    "<bos><start_of_turn>user\nHi<end_of_turn>\n",
    "a\u00a0b\u200bc\u2028d",  # nbsp, zero-width space, line separator
    "!!!???...,,,;;;:::---___===+++",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "The year 2024 had 366 days; 1,000,000 is a million.",
]

if "tok" in parts:
    cases = []
    for s in TOK_STRINGS:
        ids = tok.encode(s, add_special_tokens=False)
        ids_special = tok.encode(s, add_special_tokens=True)
        cases.append({
            "text": s,
            "ids": ids,
            "ids_add_special_tokens": ids_special,
            "tokens": tok.convert_ids_to_tokens(ids),
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            "roundtrip_exact": tok.decode(ids, skip_special_tokens=False) == s,
        })
    dump("tokenizer_cases.json", {"source": source, "note": "ids = tok.encode(text, add_special_tokens=False); special tokens present in the text are parsed as special tokens (HF default).", "cases": cases})

# ---------------------------------------------------------------- chat template
if args.family in ("smollm2", "qwen2"):
    CHATS = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Write a haiku about rust."}],
        [{"role": "system", "content": "You are a concise math tutor."},
         {"role": "user", "content": "List three primes."},
         {"role": "assistant", "content": "2, 3, and 5."},
         {"role": "user", "content": "Now list three more."}],
        [{"role": "system", "content": "Extract the fields as JSON with keys name, age, city. Output only JSON."},
         {"role": "user", "content": "My name is Alice, I am 30 years old and I live in Paris."}],
        [{"role": "user", "content": "Hi!"},
         {"role": "assistant", "content": "Hello! How can I help you today?"},
         {"role": "user", "content": "Tell me a fun fact about octopuses."}],
        [{"role": "system", "content": "You are a tool-using assistant. Available tools: get_weather(city: str) -> str. To call a tool, reply with a JSON object {\"tool\": name, \"arguments\": {...}}."},
         {"role": "user", "content": "What's the weather like in Berlin right now?"}],
    ]
else:  # gemma3 (template folds system into first user turn)
    CHATS = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Write a haiku about rust."}],
        [{"role": "user", "content": "List three primes."},
         {"role": "assistant", "content": "2, 3, and 5."},
         {"role": "user", "content": "Now list three more."}],
        [{"role": "system", "content": "Extract the fields as JSON with keys name, age, city. Output only JSON."},
         {"role": "user", "content": "My name is Alice, I am 30 years old and I live in Paris."}],
        [{"role": "user", "content": "Hi!"},
         {"role": "assistant", "content": "Hello! How can I help you today?"},
         {"role": "user", "content": "Tell me a fun fact about octopuses."}],
        [{"role": "system", "content": "You are a tool-using assistant. Available tools: get_weather(city: str) -> str. To call a tool, reply with a JSON object {\"tool\": name, \"arguments\": {...}}."},
         {"role": "user", "content": "What's the weather like in Berlin right now?"}],
    ]

def render(msgs, gen=True):
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    # tokenizing the rendered text: the template already contains any BOS it wants
    ids = tok.encode(text, add_special_tokens=False)
    return text, ids

if "chat" in parts and tok.chat_template:
    cases = []
    for msgs in CHATS:
        text, ids = render(msgs, True)
        text_nogen, ids_nogen = render(msgs, False)
        cases.append({"messages": msgs, "add_generation_prompt": True, "rendered": text, "ids": ids,
                      "rendered_no_generation_prompt": text_nogen, "ids_no_generation_prompt": ids_nogen})
    dump("chat_template_cases.json", {"source": source, "chat_template": tok.chat_template,
          "note": "rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=...); ids = tok.encode(rendered, add_special_tokens=False)",
          "cases": cases})

# ---------------------------------------------------------------- logits
def forward_full(ids):
    inp = torch.tensor([ids], dtype=torch.long)
    o = model(input_ids=inp, output_hidden_states=True, use_cache=False)
    return o

if "logits" in parts:
    LOGIT_PROMPTS = [
        ("raw_bos_only", None),  # filled below
        ("raw_short", "The capital of France is"),
        ("raw_code", "def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
        ("chat_capital", CHATS[0]),
        ("chat_multi_turn", CHATS[4]),
    ]
    if not tok.chat_template:
        LOGIT_PROMPTS[3:] = [
            ("raw_unicode", "Café, naïve, 東京, emoji 🦀 and more:"),
            ("raw_long", "Q: What is 12 times 12?\nA: 144.\nQ: What is the capital of Japan?\nA: Tokyo.\nQ: Name a prime number larger than 10.\nA:"),
        ]
    npy_dir = out / "logits_npy"
    npy_dir.mkdir(exist_ok=True)
    cases = []
    bos = tok.bos_token_id
    for name, p in LOGIT_PROMPTS:
        if p is None:
            ids = [bos] if bos is not None else tok.encode("Hello", add_special_tokens=False)
            text = tok.decode(ids)
        elif isinstance(p, str):
            # raw completion prompt: prepend BOS if the model declares one and uses it (gemma does; smollm2's bos is <|endoftext|> but llama.cpp adds no BOS for it)
            ids = tok.encode(p, add_special_tokens=True)
            text = p
        else:
            text, ids = render(p, True)
        o = forward_full(ids)
        logits = o.logits[0, -1].float()
        logp = torch.log_softmax(logits.double(), dim=-1).float()
        top = torch.topk(logits, 20)
        np.save(npy_dir / f"{name}.logprobs.npy", logp.numpy().astype(np.float32))
        np.save(npy_dir / f"{name}.logits.npy", logits.numpy().astype(np.float32))
        hs = o.hidden_states  # tuple(n_layers+1) of [1, T, H]; [0]=embeddings, [-1]=after final norm
        hs_norms = [[float(x) for x in h[0, :8].norm(dim=-1)] for h in hs]
        hs_last_norms = [float(h[0, -1].norm()) for h in hs]
        # all-position argmax (useful for checking full-sequence prefill)
        argmax_all = o.logits[0].argmax(-1).tolist()
        cases.append({
            "name": name, "text": text, "ids": ids, "n_tokens": len(ids),
            "top20": [{"id": int(i), "token": tok.convert_ids_to_tokens(int(i)), "logit": float(v), "logprob": float(logp[int(i)])} for v, i in zip(top.values, top.indices)],
            "logits_npy": f"logits_npy/{name}.logits.npy",
            "logprobs_npy": f"logits_npy/{name}.logprobs.npy",
            "logits_stats": {"mean": float(logits.mean()), "std": float(logits.std()), "min": float(logits.min()), "max": float(logits.max())},
            "argmax_per_position": argmax_all,
            "hidden_state_l2_norms_first8_positions": hs_norms,
            "hidden_state_l2_norm_last_position": hs_last_norms,
            "hidden_states_note": "index 0 = embedding output (for gemma includes sqrt(hidden) scaling), index i = output of layer i; the LAST entry has the final norm applied (HF convention)",
        })
        print(name, len(ids), [c["id"] for c in cases[-1]["top20"][:5]], flush=True)
    dump("logits_cases.json", {"source": source, "dtype": "float32 (dequantized GGUF weights), CPU, eager attention, no KV cache", "cases": cases})

# ---------------------------------------------------------------- greedy
RAW_GEN_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def is_prime(n):",
    "The three primary colors are",
    "Q: What is 12 times 12?\nA:",
    "Rust is a programming language that",
]

if "greedy" in parts:
    cases = []
    eos_ids = model.generation_config.eos_token_id
    gen_items = CHATS if tok.chat_template else RAW_GEN_PROMPTS
    for msgs in gen_items:
        if isinstance(msgs, str):
            text, ids = msgs, tok.encode(msgs, add_special_tokens=True)
        else:
            text, ids = render(msgs, True)
        inp = torch.tensor([ids], dtype=torch.long)
        t1 = time.time()
        g = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), do_sample=False,
                           max_new_tokens=args.max_new_tokens, num_beams=1,
                           temperature=None, top_p=None, top_k=None, repetition_penalty=None,
                           pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        new = g[0, len(ids):].tolist()
        # cross-check greedy via manual no-cache argmax loop for the first few tokens
        cases.append({
            "messages": msgs if not isinstance(msgs, str) else None, "prompt_rendered": text, "prompt_ids": ids,
            "generated_ids": new, "generated_text": tok.decode(new, skip_special_tokens=False),
            "generated_text_skip_special": tok.decode(new, skip_special_tokens=True),
            "stopped_on_eos": bool(len(new) < args.max_new_tokens),
            "seconds": round(time.time() - t1, 2),
        })
        print(repr(cases[-1]["generated_text"]), flush=True)
    dump("greedy_cases.json", {"source": source,
          "settings": {"do_sample": False, "max_new_tokens": args.max_new_tokens, "eos_token_id": eos_ids, "dtype": "float32", "kv_cache": "transformers default DynamicCache"},
          "note": "generation stops at eos_token_id (generation_config) or max_new_tokens; the eos token, if produced, is included in generated_ids",
          "cases": cases})

# ---------------------------------------------------------------- save safetensors
if args.save_safetensors:
    d = Path(args.save_safetensors)
    d.mkdir(parents=True, exist_ok=True)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.save_dtype]
    m = model.to(dt)
    m.save_pretrained(str(d), safe_serialization=True)
    tok.save_pretrained(str(d))
    m.generation_config.save_pretrained(str(d))
    print("saved", d, flush=True)

print(f"done in {time.time()-t0:.1f}s")
