#!/usr/bin/env python3
"""An independent reader of `kiln quantize`'s files: the `gguf` Python
package (gguf-py, llama.cpp's own) opens the GGUF, dequantizes every tensor
with its numpy dequantizers, and the matrices whose rows llama.cpp does not
permute are compared with the bf16 checkpoint they were quantized from.
Prints one JSON line; exits non-zero when a tensor fails to read or is
further from its source than its format allows.

    PYTHONPATH=~/.cache/kiln/pygguf python3 bench/gguf_py_check.py OUT.gguf HF_DIR
"""
import json, os, struct, sys
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

gguf_path, hf_dir = sys.argv[1:3]

def safetensors(dir_):
    out = {}
    for f in sorted(os.listdir(dir_)):
        if not f.endswith(".safetensors"):
            continue
        raw = open(os.path.join(dir_, f), "rb").read()
        n = struct.unpack("<Q", raw[:8])[0]
        head = json.loads(raw[8:8 + n])
        base = 8 + n
        for name, t in head.items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            buf = np.frombuffer(raw[base + a:base + b], dtype=np.uint16 if t["dtype"] == "BF16" else np.float32)
            if t["dtype"] == "BF16":
                buf = (buf.astype(np.uint32) << 16).view(np.float32)
            out[name] = buf.reshape(t["shape"])
    return out

# Relative rms error allowed per GGUF type (2-3x what each format gives trained weights).
BOUND = {"F32": 1e-6, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.02, "Q4_0": 0.3, "Q6_K": 0.05, "Q5_K": 0.08, "Q4_K": 0.15}
HF = {"ffn_down": "mlp.down_proj", "ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj",
      "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
src = safetensors(hf_dir)
r = GGUFReader(gguf_path)
arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
report = {"file": gguf_path, "arch": arch, "tensors": len(r.tensors), "types": {}, "compared": 0,
          "worst_rel_rms_by_type": {}, "failures": []}
for t in r.tensors:
    ty = t.tensor_type.name
    report["types"][ty] = report["types"].get(ty, 0) + 1
    try:
        v = dequantize(t.data, t.tensor_type).astype(np.float64)
    except Exception as e:  # a tensor gguf-py cannot read is a failure
        report["failures"].append(f"{t.name}: {e}")
        continue
    name = None
    if t.name == "token_embd.weight":
        name = "model.embed_tokens.weight"
    elif t.name.startswith("blk."):
        _, layer, base, suffix = t.name.split(".", 3)
        if base in HF:
            name = f"model.layers.{layer}.{HF[base]}.{suffix}"
    if name is None or name not in src:
        continue
    ref = src[name].astype(np.float64)
    if v.shape != ref.shape:
        report["failures"].append(f"{t.name}: shape {v.shape} vs {ref.shape}")
        continue
    err = float(np.sqrt(((v - ref) ** 2).mean() / max((ref ** 2).mean(), 1e-30)))
    report["compared"] += 1
    report["worst_rel_rms_by_type"][ty] = max(report["worst_rel_rms_by_type"].get(ty, 0.0), err)
    if err > BOUND.get(ty, 0.0):
        report["failures"].append(f"{t.name} ({ty}): relative rms error {err:.4f} > {BOUND.get(ty)}")
print(json.dumps(report))
sys.exit(1 if report["failures"] or report["compared"] == 0 else 0)
