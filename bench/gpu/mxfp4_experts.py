"""A gpt-oss checkpoint's experts in MXFP4, as the released checkpoints store them.

Reads a Hugging Face gpt-oss directory (Kiln's `dev random-checkpoint` writes one with bf16
experts: `*.experts.gate_up_proj [E, hidden, 2I]`, `*.experts.down_proj [E, I, hidden]`) and
writes a copy whose experts are `*_blocks [E, out, in/32, 16]` (two e2m1 codes a byte, low
nibble first) and `*_scales [E, out, in/32]` (e8m0, bias 127): each group of 32 inputs of an
output row scaled by 2^(floor(log2(amax)) - 2) (llama.cpp's choice: the largest magnitude lands
in [4, 8) of the scale, 6 the largest code) and every value rounded to the nearest e2m1 code.

    python3 bench/gpu/mxfp4_experts.py SRC_DIR DST_DIR
"""

import json
import os
import shutil
import sys

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

CODES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                 dtype=np.float32)


def mxfp4(w):
    """w [E, in, out] (as transformers keeps experts) -> blocks [E, out, in/32, 16], scales [E, out, in/32]."""
    rows = np.ascontiguousarray(np.swapaxes(w, 1, 2), dtype=np.float32)  # [E, out, in]
    e, out, inp = rows.shape
    g = rows.reshape(e, out, inp // 32, 32)
    amax = np.abs(g).max(axis=-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-38))) - 2, -127).clip(-127, 127)
    scales = (exp + 127).astype(np.uint8)
    x = g / np.exp2(exp)[..., None]
    # The nearest code, the first in code order on a tie.
    codes = np.abs(x[..., None] - CODES).argmin(axis=-1).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, scales


def main(src, dst):
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if not f.endswith(".safetensors") and not f.endswith(".index.json"):
            shutil.copy(os.path.join(src, f), dst)
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    weight_map = {}
    for f in files:
        out = {}
        with safe_open(os.path.join(src, f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                    b, s = mxfp4(t.float().numpy())
                    out[name + "_blocks"] = torch.from_numpy(b)
                    out[name + "_scales"] = torch.from_numpy(s)
                else:
                    out[name] = t
        save_file(out, os.path.join(dst, f), metadata={"format": "pt"})
        weight_map.update({n: f for n in out})
        print(f, len(out), "tensors", flush=True)
    if len(files) > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": weight_map}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
