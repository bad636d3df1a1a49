#!/usr/bin/env python3
"""Graph-timed sweep of the direct-load decode GEMV's tuning macros on the 8B decode shapes.

Each variant is MIN_BLOCKS,U,HALF_U (KILN_DIRECT_MIN_BLOCKS, KILN_DIRECT_U, KILN_DIRECT_HALF_U of
gemv_direct.cu). For every variant: registers and local (spill) bytes of the kernels, and for each
shape at both tile widths (16 and 8 columns; gated products run 8 only), with a block per tile
and with at most one wave of resident blocks (2 per SM) looping over the tiles, a correctness check at 1
and 3 rows against torch (f32 math on the same bf16 inputs, |d| <= 1e-2 + 1e-2 |ref|) and the
time of 24 launches recorded in a CUDA graph over rotating weight copies (L2 holds none of them),
median of 7 replays. The pipelined gemv.cu kernel (gated products) and cuBLAS (plain products of
the same bytes) run the same shapes, and a 1 GiB device copy gives the bandwidth ceiling of the
same run. Run on the GPU machine from the repo root:

    python3 bench/gpu/gemv_sweep.py --out OUT.json 2,4,8 2,3,6 3,2,4
"""
import argparse, ctypes, importlib.util, json, os, sys

import torch

spec = importlib.util.spec_from_file_location("gc", os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv_check.py"))
gc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gc)
P, I32, F32 = gc.P, gc.I32, gc.F32

D, I, NQKV, V = 4096, 14336, 6144, 49152
NCOPY = 6
EPS = 1e-5


def graph_time(launch, reps=24):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(3):
            launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(reps):
            launch(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3 / reps)
    ts.sort()
    return ts[3]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--lm", action="store_true", help="also the lm_head shape (49,152 x 4,096)")
    a = ap.parse_args()
    cuda = gc.Cuda()
    cu = cuda.cu
    cu.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    cu.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    torch.manual_seed(0)
    # name: (rows N of the weight, K, mode, norm-fused); gated modes have 2N weight rows.
    shapes = {"qkv_norm": (NQKV, D, 0, True), "o_res": (D, D, 2, False), "gate_up_norm": (I, D, 3, True),
              "down_res": (D, I, 2, False)}
    if a.lm:
        shapes["lm_norm"] = (V, D, 0, True)
    W = {k: [(torch.randn((2 * N if mode >= 3 else N), K, device="cuda") * 0.02).to(torch.bfloat16)
             for _ in range(NCOPY)] for k, (N, K, mode, _) in shapes.items()}
    # Per shape: x rows of K (contiguous), residual rows of N.
    xs = {(k, m): torch.randn(m, K, device="cuda").to(torch.bfloat16) for k, (N, K, _, _) in shapes.items() for m in (1, 3)}
    res = {(k, m): torch.randn(m, N, device="cuda").to(torch.bfloat16) for k, (N, K, _, _) in shapes.items() for m in (1, 3)}
    nw = (1.0 + 0.1 * torch.randn(I, device="cuda")).to(torch.bfloat16)
    out = torch.empty(3 * 2 * V, device="cuda", dtype=torch.bfloat16)

    def reference(k, m, i):
        N, K, mode, norm = shapes[k]
        x = xs[(k, m)].float()
        if norm:
            inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
            x = (x * inv * nw[:K].float()).to(torch.bfloat16).float()
        y = x @ W[k][i].float().t()
        if mode == 2:
            y = y + res[(k, m)].float()
        if mode == 3:
            y = torch.nn.functional.silu(y[:, :N]) * y[:, N:]
        return y

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def launcher(mod, k, m, direct, cols, wave=False):
        N, K, mode, norm = shapes[k]
        name = ("rms_norm_" if norm else "") + ("gemv_direct_bf16_m%d" if direct else "gemv_bf16_m%d") % m
        smem = m * (2 * K + 64) if (norm and direct) else 0
        extra = res[(k, m)] if mode == 2 else None
        tail = [] if direct else [I32(1), P(None), P(None)]
        nt = min(1024, max(128, ((K + 3) // 4 + 31) // 32 * 32))  # norm_threads in backend.rs
        md = mode | 8 if (direct and cols == 8 and mode < 3) else mode

        def go(i):
            args = [P(xs[(k, m)])] + ([P(nw)] if norm else []) + [P(W[k][i % NCOPY]), P(out), P(extra), I32(N), I32(K), I32(md)] + tail
            if norm:
                args += [F32(EPS), F32(0.0), I32(nt)]
            tiles = (N + cols - 1) // cols
            mod.launch(name, (min(tiles, 2 * sms) if wave else tiles,), (256,), args, smem=smem)
        return go, name

    def check(mod, k, direct, cols, wave):
        worst = 0.0
        for m in (1, 3):
            go, _ = launcher(mod, k, m, direct, cols, wave)
            go(0)
            torch.cuda.synchronize()
            N = shapes[k][0]
            ref = reference(k, m, 0)
            got = out[: m * N].view(m, N).float()
            worst = max(worst, ((got - ref).abs() - 1e-2 * ref.abs()).max().item())
        return worst

    def attrs(mod, name):
        r, l = ctypes.c_int(), ctypes.c_int()
        cu.cuFuncGetAttribute(ctypes.byref(r), 4, mod.fn(name))
        cu.cuFuncGetAttribute(ctypes.byref(l), 3, mod.fn(name))
        return {"regs": r.value, "local_bytes": l.value}

    report = {"gpu": torch.cuda.get_device_name(), "variants": {}, "failed": []}
    direct_path = os.path.join(gc.KDIR, "gemv_direct.cu")

    def run_module(label, mod, direct):
        r = {}
        if direct:
            for fn in ("gemv_direct_bf16_m1", "rms_norm_gemv_direct_bf16_m1"):
                r[fn] = attrs(mod, fn)
                if fn.startswith("rms"):
                    for m in (1, 3):
                        cuda.check(cu.cuFuncSetAttribute(mod.fn(f"rms_norm_gemv_direct_bf16_m{m}"), 8, 88 * 1024), "smem attr")
        for k, (N, K, mode, norm) in shapes.items():
            if not direct and mode < 3:
                continue
            for cols in ((8,) if mode >= 3 else (16, 8)) if direct else (16,):
                for wave in (False, True) if direct else (False,):
                    err = check(mod, k, direct, cols, wave)
                    go, _ = launcher(mod, k, 1, direct, cols, wave)
                    t = graph_time(go)
                    nbytes = (2 * N if mode >= 3 else N) * K * 2
                    key = f"{k}/{cols}" + ("/wave" if wave else "")
                    r[key] = {"us": round(t * 1e6, 2), "GBps": round(nbytes / t / 1e9, 1), "max_excess_err": err}
                    if err > 1e-2:
                        report["failed"].append(f"{label} {key}: excess error {err}")
        report["variants"][label] = r
        print(label, json.dumps(r), flush=True)

    for v in a.variants:
        minb, u, hu = (int(s) for s in v.split(","))
        defs = [f"KILN_DIRECT_MIN_BLOCKS={minb}", f"KILN_DIRECT_U={u}", f"KILN_DIRECT_HALF_U={hu}"]
        mod, _ = cuda.load(direct_path, defs)
        run_module(f"minb{minb}_u{u}_hu{hu}", mod, True)
    pipe, _ = cuda.load(os.path.join(gc.KDIR, "gemv.cu"))
    run_module("gemv_cu_pipelined", pipe, False)
    cub = {}
    for k, (N, K, mode, norm) in shapes.items():
        rows = 2 * N if mode >= 3 else N
        def mm(i, k=k, K=K, rows=rows):
            torch.matmul(xs[(k, 1)], W[k][i % NCOPY].t(), out=out[:rows].view(1, rows))
        t = graph_time(mm)
        cub[k] = {"us": round(t * 1e6, 2), "GBps": round(rows * K * 2 / t / 1e9, 1)}
    report["cublas_plain"] = cub
    print("cublas", json.dumps(cub), flush=True)
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    t = graph_time(lambda i: dst.copy_(src), reps=8)
    report["copy_GBps"] = round(2 * (1 << 30) / t / 1e9, 1)
    print("copy GB/s", report["copy_GBps"])
    json.dump(report, open(a.out, "w"), indent=1)
    sys.exit(1 if report["failed"] else 0)


if __name__ == "__main__":
    main()
