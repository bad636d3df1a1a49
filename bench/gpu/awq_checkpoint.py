#!/usr/bin/env python3
"""An AWQ checkpoint (GEMM layout, asymmetric int4 groups of 128 along the input) of a bf16
Hugging Face Llama directory, for issue 18's AWQ rows on the GPU machine, where no AWQ release
is reachable: every projection (q/k/v/o, gate/up/down) rounded to the nearest of 16 levels
between its group's min and max (`W = (q - z) * s`, s f16), packed in AutoAWQ's GEMM order
(column j's nibble i holds output 8 j + [0, 2, 4, 6, 1, 3, 5, 7][i]; qzeros alike; scales
[in / 128, out]) — the layout `kiln-formats`' quantized_st reads and the CPU tests check
against AutoAWQ's own unpacking (scripts/goldens/quantized_st.py). Embeddings, norms and
lm_head stay bf16. Runs on the GPU with torch.

    python3 bench/gpu/awq_checkpoint.py CK_DIR OUT_DIR
"""
import glob, json, os, shutil, sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

GROUP = 128
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def pack(x):
    """[rows, out] int32 codes (0..15) -> [rows, out / 8] int32 in GEMM order."""
    r, out = x.shape
    x = x.view(r, out // 8, 8)[:, :, ORDER].to(torch.int64)
    shifts = (4 * torch.arange(8, device=x.device, dtype=torch.int64))
    v = (x << shifts).sum(-1)
    return (v - ((v >> 31) & 1) * (1 << 32)).to(torch.int32)  # wrap to signed 32 bits


def awq(w):
    out, inp = w.shape
    wt = w.float().t().reshape(inp // GROUP, GROUP, out)
    lo, hi = wt.amin(1), wt.amax(1)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    sf = scale.float()
    zero = torch.round(-lo / sf).clamp(0, 15).to(torch.int32)
    q = (torch.round(wt / sf[:, None]) + zero[:, None]).clamp(0, 15).to(torch.int32)
    return pack(q.reshape(inp, out)), pack(zero), scale


def main(src, dst):
    os.makedirs(dst, exist_ok=True)
    out = {}
    for f in sorted(glob.glob(os.path.join(src, "*.safetensors"))):
        with safe_open(f, "pt", device=DEVICE) as s:
            for name in s.keys():
                t = s.get_tensor(name)
                base = name[: -len(".weight")] if name.endswith(".weight") else name
                if name.endswith(".weight") and base.split(".")[-1] in PROJ:
                    qw, qz, sc = awq(t)
                    out[f"{base}.qweight"] = qw.cpu()
                    out[f"{base}.qzeros"] = qz.cpu()
                    out[f"{base}.scales"] = sc.cpu()
                else:
                    out[name] = t.cpu()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                  "zero_point": True, "version": "gemm"}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=1)
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f in ("generation_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(src, f), dst)
    print("awq checkpoint", dst, sum(v.numel() * v.element_size() for v in out.values()) / 1e9, "GB")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
