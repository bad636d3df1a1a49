#!/usr/bin/env python3
"""FP8 GEMM ceilings on this GPU through PyTorch (cuBLASLt underneath), on the
Llama-3-8B projection shapes, for the scale granularities Kiln could use:
bf16, FP8 per-tensor, FP8 row-wise (per-token x per-channel: cuBLASLt's
OUTER_VEC), FP8 1x128 activations x 128x128 weights, and 1x128 x 1x128 (Kiln's
stored layout). Rows of x: 4,096 (a prefill) and 64/128/256 (batched decode).
Prints one JSON object: TFLOP/s a shape and mode, and the sums over one
layer's four products.

    python3 bench/gpu/fp8_gemm.py [--rows 4096,256,128,64] > fp8_gemm.json
"""
import argparse
import json

import torch

SHAPES = {  # name: (k, m) for out[n, m] = x[n, k] . w[m, k]^T
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
}
F8 = torch.float8_e4m3fn


def timed(fn, iters=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters / 1e3


def col_major(t):
    return t.t().contiguous().t()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="4096,256,128,64")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "modes": {}}
    # Ceiling: an 8192^3 bf16 product.
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    s = timed(lambda: a @ a, 10)
    out["bf16_8192_cubed_tflops"] = round(2 * 8192**3 / s / 1e12, 1)
    a8 = a.to(F8)
    one = torch.ones((), device=dev)
    a8t = col_major(a8)
    try:
        s = timed(lambda: torch._scaled_mm(a8, a8t, one, one, out_dtype=torch.bfloat16), 10)
        out["fp8_8192_cubed_tflops"] = round(2 * 8192**3 / s / 1e12, 1)
    except Exception as e:  # noqa: BLE001
        out["fp8_8192_cubed_tflops"] = f"error: {e}"[:200]
    del a, a8, a8t
    for n in [int(r) for r in args.rows.split(",")]:
        for name, (k, m) in SHAPES.items():
            x = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(m, k, device=dev, dtype=torch.bfloat16) * 0.02
            x8, w8 = x.to(F8), (w * 50).to(F8)
            wt = w8.t()  # [k, m] column-major, as _scaled_mm wants its second operand
            sx_row, sw_row = torch.ones(n, 1, device=dev), torch.ones(1, m, device=dev)
            sx_blk = col_major(torch.ones(n, k // 128, device=dev))
            sw_blk, sw_run = torch.ones(k // 128, m // 128, device=dev), torch.ones(k // 128, m, device=dev)
            modes = {
                "bf16": lambda: x @ w.t(),
                "fp8_tensor": lambda: torch._scaled_mm(x8, wt, one, one, out_dtype=torch.bfloat16),
                "fp8_rowwise": lambda: torch._scaled_mm(x8, wt, sx_row, sw_row, out_dtype=torch.bfloat16),
                "fp8_1x128_128x128": lambda: torch._scaled_mm(x8, wt, sx_blk, sw_blk, out_dtype=torch.bfloat16),
            }
            # (Which layout PyTorch wants for B's 1x128 scales is tried, not assumed.)
            for i, sw in enumerate([sw_run, col_major(torch.ones(m, k // 128, device=dev)),
                                    torch.ones(m, k // 128, device=dev)]):
                try:
                    torch._scaled_mm(x8, wt, sx_blk, sw, out_dtype=torch.bfloat16)
                except Exception:  # noqa: BLE001
                    continue
                modes[f"fp8_1x128_1x128"] = lambda sw=sw: torch._scaled_mm(
                    x8, wt, sx_blk, sw, out_dtype=torch.bfloat16)
                out.setdefault("b_1x128_scale_layout", i)
                break
            for mode, fn in modes.items():
                key = f"{n}:{name}"
                try:
                    s = timed(fn)
                    r = {"us": round(s * 1e6, 1), "tflops": round(2 * n * k * m / s / 1e12, 1)}
                except Exception as e:  # noqa: BLE001
                    r = {"error": f"{e}"[:160]}
                out["modes"].setdefault(mode, {})[key] = r
    # A layer's four products, each mode against bf16.
    layer = {}
    for mode, rows in out["modes"].items():
        for n in [int(r) for r in args.rows.split(",")]:
            us = [rows.get(f"{n}:{s}", {}).get("us") for s in SHAPES]
            if all(isinstance(u, float) for u in us):
                layer.setdefault(str(n), {})[mode] = round(sum(us), 1)
    out["layer_us"] = layer
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
