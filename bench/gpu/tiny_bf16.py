"""Is a tiny hybrid's CUDA row that parts from Kiln's CPU (f32) a property of bf16 itself?
transformers runs the checkpoint in f32 and in bf16 on the GPU; per row, the cosine of each
against the f32 logits, next to Kiln CUDA's (a .npy from `kiln dev logits`).
  python3 bench/gpu/tiny_bf16.py CKPT IDS KILN_CUDA.npy [KILN_CPU.npy]"""
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

ckpt, ids = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
x = torch.tensor([ids], device="cuda")
out = {}
for name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
    m = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dt).to("cuda").eval()
    with torch.no_grad():
        out[name] = m(x).logits[0].float().cpu().numpy().astype(np.float64)
cos = lambda a, b: (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
ref = out["f32"]
rows = {"hf bf16": out["bf16"], "kiln cuda": np.load(sys.argv[3]).astype(np.float64)}
if len(sys.argv) > 4:
    rows["kiln cpu"] = np.load(sys.argv[4]).astype(np.float64)
for k, v in rows.items():
    c = cos(v, ref)
    print(f"{k} vs hf f32: min {c.min():.4f} at row {c.argmin()}; rows", " ".join(f"{t:.3f}" for t in c))
c = cos(rows["kiln cuda"], out["bf16"])
print(f"kiln cuda vs hf bf16: min {c.min():.4f} at row {c.argmin()}; rows", " ".join(f"{t:.3f}" for t in c))
