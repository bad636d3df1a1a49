#!/usr/bin/env python3
"""Check Kiln's model code against Hugging Face transformers on random-weight
checkpoints of the variants no real model here covers: Llama 3 RoPE scaling,
linear RoPE scaling with attention biases, Qwen3 (per-head q/k RMSNorm,
head_dim != hidden/heads), Mistral (sliding window shorter than the prompt).

For each config: `kiln dev random-checkpoint` writes an f32 safetensors
directory, `kiln dev logits` writes Kiln's logits for a prompt, and
transformers (float32, eager attention, CPU) computes its own on the same
directory. Reports max |Δ log-softmax| over every position and whether the
top-20 ids agree at the last position; exits non-zero past 1e-3.

Runs where torch and transformers are installed (the GPU machine):
    python3 bench/oracle/oracle_models.py --kiln target/release/kiln --out results.json
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM

BASE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}

CONFIGS = {
    "llama3_rope_scaling": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama",
                                rope_theta=500000.0, tie_word_embeddings=False,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_linear_rope_bias": dict(BASE, architectures=["LlamaForCausalLM"], model_type="llama",
                                   rope_theta=10000.0, attention_bias=True, tie_word_embeddings=True,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen3_qk_norm": dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=64,
                          rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False),
    "mistral_sliding_window": dict(BASE, architectures=["MistralForCausalLM"], model_type="mistral",
                                   rope_theta=10000.0, sliding_window=48, tie_word_embeddings=False),
    "qwen2_bias": dict(BASE, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                       rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
}


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--tokenizer", default=os.path.join(os.path.dirname(__file__), "..", "smollm2-tokenizer"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    rng = np.random.default_rng(0)
    ids = [1] + rng.integers(3, 49152, size=args.tokens - 1).tolist()
    results, ok = {}, True
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in CONFIGS.items():
            d = os.path.join(tmp, name)
            cfg_path = os.path.join(tmp, name + ".json")
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
            subprocess.run([args.kiln, "dev", "random-checkpoint", "--preset", "tiny", "--config", cfg_path,
                            "--tokenizer", args.tokenizer, "--dtype", "f32", "--seed", "3", "-o", d], check=True)
            npy = os.path.join(tmp, name + ".npy")
            subprocess.run([args.kiln, "dev", "logits", "-m", d, "--ids", ",".join(map(str, ids)), "-o", npy],
                           check=True)
            kiln = np.load(npy)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
            model.eval()
            hf = model(torch.tensor([ids])).logits[0].float().numpy()
            lk, lh = log_softmax(kiln), log_softmax(hf)
            max_diff = float(np.abs(lk - lh).max())
            top_k = np.argsort(-kiln[-1])[:20].tolist()
            top_h = np.argsort(-hf[-1])[:20].tolist()
            argmax_agree = float((kiln.argmax(-1) == hf.argmax(-1)).mean())
            passed = max_diff <= 1e-3 and top_k == top_h
            ok &= passed
            results[name] = {"max_abs_logprob_diff": max_diff, "top20_equal_last": top_k == top_h,
                             "argmax_agreement_all_positions": argmax_agree, "tokens": len(ids),
                             "passed": passed, "config": cfg}
            print(f"{name:28s} max|Δlogprob| {max_diff:.2e}  top20 {'=' if top_k == top_h else '≠'}  "
                  f"argmax agree {argmax_agree:.3f}  {'PASS' if passed else 'FAIL'}", flush=True)
    import transformers
    report = {"oracle": "transformers " + transformers.__version__ + ", torch " + torch.__version__ +
              ", float32, eager attention, CPU", "results": results, "passed": ok}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
