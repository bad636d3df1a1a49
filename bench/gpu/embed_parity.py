#!/usr/bin/env python3
"""Kiln CUDA sentence embeddings against transformers on random checkpoints (GPU machine).

Two encoders, random weights, the sentence-transformers head of the real model beside them:
- bert: all-MiniLM-L6-v2's shape (BertModel; mean pooling, Normalize), its tokenizer;
- egemma: EmbeddingGemma-300M's shape (gemma3_text, bidirectional; a checkpoint from
  `kiln dev random-checkpoint`), mean pooling, two random Dense layers, Normalize.
The inputs are the 30 golden cases' token ids (testdata/goldens/embeddings; EmbeddingGemma's
folded into the random checkpoint's vocabulary), inputs at the length limit included. The
oracle: transformers' last hidden state (f32 and bf16, one sequence a forward), mean over the
tokens, the Dense layers in f32, L2 normalization — what sentence-transformers does with these
modules. Kiln: `kiln embed --device cuda --ids`, all inputs in one step, and a few alone.

    python3 bench/gpu/embed_parity.py --kiln .device/kiln --work DIR --egemma CK --out embed.json
"""
import argparse, json, os, shutil, subprocess

import numpy as np
import torch
from safetensors.torch import save_file, load_file
from transformers import AutoModel, BertConfig, BertModel

DEV = os.environ.get("PARITY_DEVICE", "cuda")  # cpu: a dry run of the script here
KDEV = "cuda" if DEV == "cuda" else "cpu"
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")


def make_bert(d):
    shutil.copytree(os.path.join(HERE, "st", "minilm"), d, dirs_exist_ok=True)
    torch.manual_seed(0)
    c = BertConfig.from_pretrained(d)
    # Wider than BERT's 0.02 init, so random inputs get embeddings that differ.
    c.initializer_range = 0.1
    m = BertModel(c)
    m.save_pretrained(d)


def make_egemma_head(d):
    shutil.copytree(os.path.join(HERE, "st", "embeddinggemma"), d, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(1)
    h = json.load(open(os.path.join(d, "config.json")))["hidden_size"]
    for sub, (o, i) in (("2_Dense", (4 * h, h)), ("3_Dense", (h, 4 * h))):
        c = json.load(open(os.path.join(d, sub, "config.json")))
        c["in_features"], c["out_features"] = i, o
        json.dump(c, open(os.path.join(d, sub, "config.json"), "w"))
        save_file({"linear.weight": torch.randn(o, i, generator=g) / i**0.5}, os.path.join(d, sub, "model.safetensors"))


def head_layers(d):
    mods = json.load(open(os.path.join(d, "modules.json")))
    return [load_file(os.path.join(d, m["path"], "model.safetensors"))["linear.weight"].to(DEV)
            for m in mods if m["type"].endswith("Dense")]


def oracle(d, inputs, dtype):
    m = AutoModel.from_pretrained(d, dtype=dtype, attn_implementation="eager" if "bert" in d else "sdpa").to(DEV).eval()
    dense = head_layers(d)
    out = []
    with torch.no_grad():
        for ids in inputs:
            h = m(input_ids=torch.tensor([ids], device=DEV)).last_hidden_state[0].float()
            v = h.mean(0)
            for w in dense:
                v = w @ v
            out.append(torch.nn.functional.normalize(v, dim=0).cpu().numpy())
    del m
    torch.cuda.empty_cache() if DEV == "cuda" else None
    return np.stack(out)


def kiln_embed(kiln, d, inputs):
    text = "\n".join(",".join(map(str, ids)) for ids in inputs) + "\n"
    r = subprocess.run([kiln, "embed", "--device", KDEV, "-m", d, "--ids"], input=text, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return np.array([json.loads(l) for l in r.stdout.splitlines() if l.strip()])


def cos_rows(a, b):
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--egemma", required=True, help="a random EmbeddingGemma-shaped checkpoint dir")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    gold = os.path.join(ROOT, "testdata", "goldens", "embeddings")
    bert = os.path.join(a.work, "bert-minilm")
    make_bert(bert)
    make_egemma_head(a.egemma)
    rep = {}
    for name, d, golden in (("bert-minilm-shape", bert, "all-MiniLM-L6-v2.json"),
                            ("embeddinggemma-300m-shape", a.egemma, "embeddinggemma-300m.json")):
        vocab = json.load(open(os.path.join(d, "config.json")))["vocab_size"]
        cases = json.load(open(os.path.join(gold, golden)))["cases"]
        inputs = [[i % vocab for i in c["input_ids"]] for c in cases]
        k = kiln_embed(a.kiln, d, inputs)
        f32 = oracle(d, inputs, torch.float32)
        b16 = oracle(d, inputs, torch.bfloat16)
        alone_idx = [0, 1, len(inputs) // 2, len(inputs) - 1]
        alone = [kiln_embed(a.kiln, d, [inputs[i]])[0] for i in alone_idx]
        c32, c16, o = cos_rows(k, f32), cos_rows(k, b16), cos_rows(b16, f32)
        # Less the component every input shares (the oracle's mean vector).
        mu = f32.mean(0)
        cc = cos_rows(k - mu, f32 - mu)
        rep[name] = {
            "inputs": len(inputs),
            "lengths": {"min": min(map(len, inputs)), "max": max(map(len, inputs))},
            "kiln_cuda_vs_hf_f32_cosine_min": float(c32.min()),
            "kiln_cuda_vs_hf_f32_cosine_mean": float(c32.mean()),
            "kiln_cuda_vs_hf_bf16_cosine_min": float(c16.min()),
            "kiln_cuda_vs_hf_f32_centered_cosine_min": float(cc.min()),
            "hf_bf16_vs_hf_f32_centered_cosine_min": float(cos_rows(b16 - mu, f32 - mu).min()),
            "hf_bf16_vs_hf_f32_cosine_min": float(o.min()),
            "worst_input": cases[int(c32.argmin())]["name"],
            "alone_vs_batched_bit_identical": [bool(np.array_equal(alone[j], k[i])) for j, i in enumerate(alone_idx)],
            "alone_vs_batched_max_abs": float(max(np.abs(alone[j] - k[i]).max() for j, i in enumerate(alone_idx))),
            "distinct_inputs_cosine_max": float(max(cos_rows(k[:-1], k[1:]))),
        }
        print(name, json.dumps(rep[name]), flush=True)
    json.dump(rep, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
