#!/usr/bin/env python3
"""Correctness and speed of Kiln's decode GEMV (gemv.cu, gemv_direct.cu, their RMSNorm-fused variants), the
skinny GEMM for 9..64 rows (skinny.cu, against torch.matmul / cuBLAS) and fused glue kernels (fused.cu).

Standalone: compiles the .cu files with NVRTC through ctypes, loads them with the CUDA driver API
(libcuda through ctypes), launches them on torch tensors and compares with torch references in f32
(from the same bf16 inputs). Run on the GPU machine from the repo root:
    python3 bench/gpu/gemv_check.py --out $OUT/gemv_check.json

Tolerance for bf16 outputs: |kiln - ref| <= 1e-2 + 1e-2 * |ref| elementwise (ref in f32/f64).
Timings: CUDA events around single launches with L2 flushed before each (a 512 MiB memset), median
of 50 after warmup; achieved GB/s = weight bytes / time; compared with torch.matmul (cuBLAS) on the
same shapes and with device-to-device copy bandwidth (clone of 1 GiB, read + write counted).
"clean" timings flush L2 by reading 512 MiB instead (the memset leaves up to an L2 of dirty lines
that get written back while the GEMV runs; a decode step's previous kernel mostly leaves clean ones).
"back-to-back" launches 24 GEMVs in a row over rotating weight copies; through ctypes a launch costs
~45 us of host time, so it is host-bound (meaningless) for anything under ~50 us of GPU time.
"launch floor": the same timings of a one-block GEMV (~4.1 us with either flush on H200).
GEMV launches follow the host rule at the top of gemv.cu (gemv_launch below); the workspace and the
tile counters are allocated zeroed once, shared by every launch, and checked to be zero again.
Exits 1 on any correctness failure (the JSON report is written either way).
"""
import argparse, ctypes, glob, json, math, os, re, sys, time

import torch
import torch.nn.functional as F

REPO = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
KDIR = os.path.join(REPO, "crates", "kiln-cuda", "src", "kernels")
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda-13.0")


# ------------------------------------------------------------------------------------------------
# NVRTC + driver API through ctypes
# ------------------------------------------------------------------------------------------------
def _find_lib(names):
    cands = []
    for d in [os.path.join(CUDA_HOME, "lib64"), os.path.join(CUDA_HOME, "lib"), "/usr/local/cuda/lib64",
              "/usr/lib/x86_64-linux-gnu"]:
        for n in names:
            cands += sorted(glob.glob(os.path.join(d, n + "*")))
    for sp in sys.path:
        for n in names:
            cands += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib", n + "*")))
            cands += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "*", "lib", n + "*")))
    for c in cands:
        try:
            return ctypes.CDLL(c), c
        except OSError:
            pass
    for n in names:
        for suffix in ["", ".13", ".1"]:
            try:
                return ctypes.CDLL(n + suffix), n + suffix
            except OSError:
                pass
    raise RuntimeError(f"cannot load any of {names}")


def _include_dirs():
    dirs = []
    for d in [os.path.join(CUDA_HOME, "include"), os.path.join(CUDA_HOME, "include", "cccl"),
              os.path.join(CUDA_HOME, "targets", "x86_64-linux", "include")]:
        if os.path.isdir(d):
            dirs.append(d)
    return dirs


def expand(src):
    out = []
    for line in src.splitlines():
        m = re.match(r'\s*#include "(.+)"', line)
        if m:
            out.append(open(os.path.join(KDIR, m.group(1))).read().replace("#pragma once", ""))
        else:
            out.append(line)
    return "\n".join(out)


class Cuda:
    def __init__(self):
        torch.zeros(1, device="cuda")  # torch creates and binds the primary context
        self.nvrtc, self.nvrtc_path = _find_lib(["libnvrtc.so"])
        # NVRTC dlopens its builtins library by soname: preload the one next to libnvrtc.
        for b in sorted(glob.glob(os.path.join(os.path.dirname(os.path.realpath(self.nvrtc_path)),
                                               "libnvrtc-builtins.so*"))):
            try:
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError:
                pass
        try:  # the driver torch already loaded (never a toolkit stub)
            self.cu = ctypes.CDLL("libcuda.so.1")
        except OSError:
            self.cu, _ = _find_lib(["libcuda.so"])
        cu = self.cu
        cu.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        cu.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        cu.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p,
                                                                                ctypes.POINTER(ctypes.c_void_p),
                                                                                ctypes.c_void_p]
        cu.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self.check(cu.cuInit(0), "cuInit")
        ctx = ctypes.c_void_p()
        self.check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self.check(cu.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()), "cuDeviceGet")
            cu.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
            self.check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            cu.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            self.check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.modules = []

    def check(self, rc, what):
        if rc != 0:
            s = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(s))
            raise RuntimeError(f"{what} failed: {rc} {s.value.decode() if s.value else ''}")

    def compile(self, path, arch, defines=()):
        nv = self.nvrtc
        src = expand(open(path).read()).encode()
        prog = ctypes.c_void_p()
        rc = nv.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(path).encode(), 0, None, None)
        assert rc == 0, f"nvrtcCreateProgram {rc}"
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"] + [b"-I" + d.encode() for d in _include_dirs()]
        opts += [f"-D{d}".encode() for d in defines]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
        n = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        nv.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise RuntimeError(f"NVRTC failed on {path} ({arch}):\n{log.value.decode()}")
        if arch.startswith("sm_"):
            nv.nvrtcGetCUBINSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value)
            nv.nvrtcGetCUBIN(prog, buf)
        else:
            nv.nvrtcGetPTXSize(prog, ctypes.byref(n))
            buf = ctypes.create_string_buffer(n.value)
            nv.nvrtcGetPTX(prog, buf)
        return buf

    def load(self, path, defines=()):
        """Module from compute_90 PTX (driver JIT); falls back to an sm_XY cubin from NVRTC."""
        mod = ctypes.c_void_p()
        image = self.compile(path, "compute_90", defines)
        rc = self.cu.cuModuleLoadData(ctypes.byref(mod), image)
        how = "compute_90 ptx"
        if rc != 0:
            major, minor = torch.cuda.get_device_capability()
            image = self.compile(path, f"sm_{major}{minor}", defines)
            self.check(self.cu.cuModuleLoadData(ctypes.byref(mod), image), f"cuModuleLoadData({path})")
            how = f"sm_{major}{minor} cubin (ptx load failed with {rc})"
        self.modules.append((mod, image))
        return Module(self, mod), how


class Module:
    def __init__(self, cuda, mod):
        self.cuda, self.mod, self.fns = cuda, mod, {}

    def fn(self, name):
        if name not in self.fns:
            f = ctypes.c_void_p()
            self.cuda.check(self.cuda.cu.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
            self.fns[name] = f
        return self.fns[name]

    def occupancy(self, name, block=256, smem=0):
        """Resident blocks per SM the driver reports for a kernel."""
        n = ctypes.c_int()
        cu = self.cuda.cu
        cu.cuOccupancyMaxActiveBlocksPerMultiprocessor.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p,
                                                                    ctypes.c_int, ctypes.c_size_t]
        self.cuda.check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self.fn(name), block, smem),
                        "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return n.value

    def launch(self, name, grid, block, args, smem=0):
        """args: ctypes values (c_uint64 pointers, c_int32, c_int64, c_float)."""
        f = self.fn(name)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.cuda.check(self.cuda.cu.cuLaunchKernel(f, *grid, *block, smem, stream, params, None), name)


def P(t):
    return ctypes.c_uint64(0 if t is None else t.data_ptr())


I32, I64, F32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float


# ------------------------------------------------------------------------------------------------
# comparison helpers
# ------------------------------------------------------------------------------------------------
FAILS = []


def close(name, got, ref, atol=1e-2, rtol=1e-2):
    got, ref = got.double(), ref.double()
    err = (got - ref).abs()
    bad = ~(err <= atol + rtol * ref.abs())  # NaN counts as bad
    nbad = int(bad.sum())
    res = {"max_abs_err": float(err.nan_to_num(float("inf")).max()) if err.numel() else 0.0,
           "n_bad": nbad, "n": int(ref.numel()), "ok": nbad == 0}
    if nbad:
        idx = bad.flatten().nonzero()[:5].flatten().tolist()
        res["first_bad"] = [[i, float(got.flatten()[i]), float(ref.flatten()[i])] for i in idx]
        FAILS.append(name)
        print(f"FAIL {name}: {nbad}/{ref.numel()} bad, first {res['first_bad']}")
    return res


def exact(name, cond, detail=""):
    if not cond:
        FAILS.append(name)
        print(f"FAIL {name} {detail}")
    return {"ok": bool(cond), **({"detail": detail} if detail else {})}


# ------------------------------------------------------------------------------------------------
# GEMV
# ------------------------------------------------------------------------------------------------
NUM_SMS = None  # set in main from the device
WS = None  # f32 workspace, zero between launches
CNT = None  # u32 tile counters, zero between launches
WS_FLOATS = 1 << 21
CNT_LEN = 1 << 14


def gemv_launch(N, K, M, mode, use_ws=False, num_sms=None):
    """The host rule from the top of gemv.cu, verbatim: (splits, grid.x). use_ws: the split-K path."""
    num_sms = num_sms or NUM_SMS
    tiles = (N + 15) // 16
    steps = tiles * ((K + 255) // 256)
    if use_ws:
        return 2, min(2 * num_sms, steps)
    return 1, tiles


def run_gemv(mod, M, x, w, out, extra, N, K, mode, splits=None, grid=None):
    """splits/grid None: the host rule."""
    if splits is None:
        splits, g = gemv_launch(N, K, M, mode)
        grid = grid or g
    elif grid is None:
        grid = gemv_launch(N, K, M, mode, use_ws=splits >= 2)[1]
    rows = 2 * N if mode >= 3 else N
    assert M * rows <= WS_FLOATS and (N + 15) // 16 <= CNT_LEN
    ws, cnt = (WS, CNT) if splits >= 2 else (None, None)
    mod.launch(f"gemv_bf16_m{M}", (grid,), (256,), [P(x), P(w), P(out), P(extra), I32(N), I32(K), I32(mode),
                                                    I32(splits), P(ws), P(cnt)])


def ws_zero():
    return bool((WS == 0).all()) and bool((CNT == 0).all())


def gemv_ref(x, w, extra, N, mode):
    y = x.float() @ w.float().t()
    if mode == 0:
        return y
    if mode == 1:
        return y + extra.float()[None, :]
    if mode == 2:
        return y + extra.float()
    g, u = y[:, :N], y[:, N:]
    return (F.silu(g) if mode == 3 else F.gelu(g, approximate="tanh")) * u


def test_gemv(mod, report):
    torch.manual_seed(0)
    res = {}
    plain = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (49152, 4096), (1536, 576), (1000, 4096),
             (1000, 584), (24, 8)]
    gated = [(14336, 4096), (3072, 4096), (1000, 4096), (768, 576), (500, 584)]
    cases = [(N, K, mode) for (N, K) in plain for mode in (0, 1, 2)] + \
            [(N, K, mode) for (N, K) in gated for mode in (3, 4)]
    wcache = {}
    for (N, K, mode) in cases:
        rows = 2 * N if mode >= 3 else N
        if (rows, K) not in wcache:
            wcache.clear()
            wcache[(rows, K)] = (torch.randn(rows, K, device="cuda") / math.sqrt(K)).to(torch.bfloat16)
        w = wcache[(rows, K)]
        for M in (1, 2, 3, 4, 5, 7, 8):
            if M in (3, 5, 7) and (N, K) not in [(1000, 584), (4096, 4096), (500, 584)]:
                continue
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            pad = 256
            buf = torch.full((M * N + pad,), float("nan"), device="cuda", dtype=torch.bfloat16)
            out = buf[: M * N].view(M, N)
            extra = None
            variants = ["sep"]
            if mode == 1:
                extra = torch.randn(N, device="cuda").to(torch.bfloat16)
            if mode == 2:
                extra = torch.randn(M, N, device="cuda").to(torch.bfloat16)
                variants = ["alias", "sep"] if (N, K) in [(4096, 4096), (1000, 584)] else ["alias"]
            ref = gemv_ref(x, w, extra, N, mode)
            tiles = (N + 15) // 16
            # (splits, grid): no workspace; split-K; odd grids (uneven / tiny / oversized).
            launches = [(1, tiles), gemv_launch(N, K, M, mode, use_ws=True), (2, 4 * NUM_SMS)]
            if (N, K) in [(4096, 4096), (1000, 584), (500, 584), (24, 8), (4096, 14336)] and M in (1, 3, 8):
                launches += [(1, 5), (2, 7), (2, 1), (2, 3 * tiles * ((K + 255) // 256) + 1), (2, 1000)]
            for var in variants:
                for (sp, gr) in launches:
                    buf.fill_(float("nan"))
                    ex = extra
                    if var == "alias":
                        out.copy_(extra)
                        ex = out
                    run_gemv(mod, M, x, w, out, ex, N, K, mode, splits=sp, grid=gr)
                    torch.cuda.synchronize()
                    name = f"gemv M={M} N={N} K={K} mode={mode} splits={sp} grid={gr}" + \
                           (" alias" if var == "alias" else "")
                    r = close(name, out.float(), ref)
                    tail_ok = bool(torch.isnan(buf[M * N:].float()).all())
                    r["tail_untouched"] = exact(name + " tail", tail_ok)["ok"]
                    r["ws_zero_after"] = exact(name + " ws/counters zero after", ws_zero())["ok"]
                    if not r["ws_zero_after"]:
                        WS.zero_()
                        CNT.zero_()
                    res[name] = r
    n_ok = sum(1 for r in res.values() if r["ok"] and r["tail_untouched"] and r["ws_zero_after"])
    print(f"gemv: {n_ok}/{len(res)} cases ok")
    report["gemv"] = res


# ------------------------------------------------------------------------------------------------
# argmax + logprob
# ------------------------------------------------------------------------------------------------
def test_argmax(mod, report):
    torch.manual_seed(1)
    res = {}
    for dtype, name, rows, V in [(torch.bfloat16, "argmax_logprob_bf16", 4, 49152),
                                 (torch.float32, "argmax_logprob_f32", 4, 49152),
                                 (torch.float32, "argmax_logprob_f32", 3, 151936),
                                 (torch.bfloat16, "argmax_logprob_bf16", 2, 1000)]:
        logits = (torch.randn(rows, V, device="cuda") * 3).to(dtype)
        logits[1, 100] = 20.0  # tie: lowest index wins
        logits[1, V - 7] = 20.0
        logits[1, 5000 % V] = 20.0
        if rows > 2:
            logits[2, V - 1] = 25.0  # max at the last index
        if rows > 3:
            logits[3].fill_(0.5)  # all equal -> index 0, logprob -log V
        ids = torch.full((rows,), 0xFFFF, device="cuda", dtype=torch.int32)
        lp = torch.full((rows,), float("nan"), device="cuda", dtype=torch.float32)
        mod.launch(name, (rows,), (1024,), [P(logits), I32(V), P(ids), P(lp)])
        torch.cuda.synchronize()
        lf = logits.float()
        mx = lf.max(dim=1).values
        ref_ids = torch.stack([(lf[r] == mx[r]).nonzero()[0, 0] for r in range(rows)])
        ref_lp = lf.gather(1, ref_ids[:, None])[:, 0] - torch.logsumexp(lf.double(), dim=1).float()
        key = f"{name} [{rows},{V}]"
        r = {"ids": ids.tolist(), "ref_ids": ref_ids.tolist()}
        r["ids_ok"] = exact(key + " ids", ids.long().tolist() == ref_ids.tolist(),
                            f"{ids.tolist()} vs {ref_ids.tolist()}")["ok"]
        r["logprob"] = close(key + " logprob", lp, ref_lp, atol=1e-4, rtol=1e-5)
        res[key] = r
    print(f"argmax: {sum(1 for r in res.values() if r['ids_ok'] and r['logprob']['ok'])}/{len(res)} ok")
    report["argmax"] = res


# ------------------------------------------------------------------------------------------------
# fused kernels
# ------------------------------------------------------------------------------------------------
def rope_ref(x, pos, inv_freq, half, scaling):
    """x [n, h, hd] f32 from bf16; angle in f32 as the kernel computes it, sin/cos in f64."""
    ang = (inv_freq[None, :] * pos.float()[:, None])  # f32 product, same as the kernel
    c = torch.cos(ang.double()) * scaling
    s = torch.sin(ang.double()) * scaling
    x = x.double().clone()
    a, b = x[..., :half].clone(), x[..., half:2 * half].clone()
    x[..., :half] = a * c[:, None, :] - b * s[:, None, :]
    x[..., half:2 * half] = b * c[:, None, :] + a * s[:, None, :]
    return x


def test_qkv_rope(mod, report):
    torch.manual_seed(2)
    res = {}
    for (heads, kv, hd, half, scaling, n, block) in [(32, 8, 128, 64, 1.0, 7, 256), (9, 3, 64, 32, 1.0, 5, 128),
                                                     (8, 2, 128, 32, 0.9, 6, 128), (4, 1, 80, 20, 1.0, 3, 256),
                                                     (2, 2, 576, 288, 1.0, 2, 256)]:
        width = (heads + 2 * kv) * hd
        stride = width + 8
        slots_total = 64
        qkv0 = torch.randn(n, stride, device="cuda").to(torch.bfloat16)
        qkv = qkv0.clone()
        pos = torch.randint(0, 100000, (n,), device="cuda", dtype=torch.int32)
        pos[0] = 0
        slots = torch.randperm(slots_total, device="cuda")[:n].to(torch.int32)
        inv_freq = (1.0 / (500000.0 ** (torch.arange(0, 2 * half, 2, device="cuda").float() / (2 * half)))).float()
        kc = torch.full((slots_total, kv * hd), 7.0, device="cuda", dtype=torch.bfloat16)
        vc = torch.full((slots_total, kv * hd), 7.0, device="cuda", dtype=torch.bfloat16)
        mod.launch("qkv_rope_write_bf16", (n, heads + kv), (block,),
                   [P(qkv), I64(stride), P(kc), P(vc), P(pos), P(slots), P(inv_freq), I32(half), F32(scaling),
                    I32(heads), I32(kv), I32(hd)])
        torch.cuda.synchronize()
        key = f"qkv_rope heads={heads} kv={kv} hd={hd} half={half} scaling={scaling}"
        q0 = qkv0[:, : heads * hd].view(n, heads, hd).float()
        k0 = qkv0[:, heads * hd: (heads + kv) * hd].view(n, kv, hd).float()
        v0 = qkv0[:, (heads + kv) * hd: width]
        qr = rope_ref(q0, pos, inv_freq, half, scaling)
        kr = rope_ref(k0, pos, inv_freq, half, scaling)
        r = {"q": close(key + " q", qkv[:, : heads * hd].view(n, heads, hd).float(), qr),
             "k_in_qkv": close(key + " k in qkv", qkv[:, heads * hd: (heads + kv) * hd].view(n, kv, hd).float(), kr),
             "k_cache": close(key + " k_cache", kc[slots.long()].view(n, kv, hd).float(), kr),
             "v_cache": exact(key + " v_cache", torch.equal(vc[slots.long()], v0)),
             "v_in_qkv_unchanged": exact(key + " v in qkv", torch.equal(qkv[:, (heads + kv) * hd:],
                                                                        qkv0[:, (heads + kv) * hd:]))}
        others = torch.ones(slots_total, dtype=torch.bool, device="cuda")
        others[slots.long()] = False
        r["other_slots_untouched"] = exact(key + " other slots",
                                           bool((kc[others] == 7.0).all()) and bool((vc[others] == 7.0).all()))
        if 2 * half < hd:
            r["passthrough_exact"] = exact(key + " passthrough",
                                           torch.equal(qkv[:, : heads * hd].view(n, heads, hd)[..., 2 * half:],
                                                       qkv0[:, : heads * hd].view(n, heads, hd)[..., 2 * half:])
                                           and torch.equal(kc[slots.long()].view(n, kv, hd)[..., 2 * half:],
                                                           qkv0[:, heads * hd:(heads + kv) * hd].view(n, kv, hd)[..., 2 * half:]))
        res[key] = r
    report["qkv_rope_write"] = res


def test_gated_act(mod, report):
    torch.manual_seed(3)
    res = {}
    for (rows, inter) in [(37, 14336), (3, 1001), (1, 8)]:
        gu = (torch.randn(rows, 2 * inter, device="cuda") * 2).to(torch.bfloat16)
        for act in (0, 1):
            out = torch.full((rows, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
            n = rows * inter
            grid = max(1, min((n + 256 * 8 - 1) // (256 * 8), 65535))
            mod.launch("gated_act_packed_bf16", (grid,), (256,), [P(gu), P(out), I64(rows), I32(inter), I32(act)])
            torch.cuda.synchronize()
            g, u = gu[:, :inter].float(), gu[:, inter:].float()
            ref = (F.silu(g) if act == 0 else F.gelu(g, approximate="tanh")) * u
            res[f"rows={rows} inter={inter} act={act}"] = close(f"gated_act_packed {rows}x{inter} act={act}", out.float(), ref)
    report["gated_act_packed"] = res


def test_bias_residual(mod, report):
    torch.manual_seed(4)
    res = {}
    for (rows, m) in [(5, 4096), (3, 1001), (2, 576)]:
        x0 = torch.randn(rows, m, device="cuda").to(torch.bfloat16)
        bias = torch.randn(m, device="cuda").to(torch.bfloat16)
        resid = torch.randn(rows, m, device="cuda").to(torch.bfloat16)
        for (b, rr) in [(bias, resid), (bias, None), (None, resid)]:
            x = x0.clone()
            n = rows * m
            grid = max(1, min((n + 256 * 8 - 1) // (256 * 8), 65535))
            mod.launch("bias_residual_bf16", (grid,), (256,), [P(x), P(b), P(rr), I64(rows), I32(m)])
            torch.cuda.synchronize()
            ref = x0.float() + (b.float()[None, :] if b is not None else 0) + (rr.float() if rr is not None else 0)
            key = f"rows={rows} m={m} bias={b is not None} residual={rr is not None}"
            res[key] = close("bias_residual " + key, x.float(), ref)
    report["bias_residual"] = res


def test_rms_norm_rows(mod, report):
    torch.manual_seed(5)
    res = {}
    for (rows, d, xs, os_, off, block) in [(6, 4096, 4096 + 64, 4096, 0.0, 256), (4, 576, 576 * 3, 576 + 8, 1.0, 256),
                                           (3, 999, 1003, 999, 0.0, 256), (2, 128, 128, 136, 1.0, 128),
                                           (5, 4096, 4096, 4096, 0.0, 1024)]:
        xb = torch.randn(rows, xs, device="cuda").to(torch.bfloat16)
        ob = torch.full((rows, os_), float("nan"), device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(d, device="cuda") * 0.1 + (0.0 if off else 1.0)).to(torch.bfloat16)
        eps = 1e-6
        mod.launch("rms_norm_rows_bf16", (rows,), (block,),
                   [P(xb), I64(xs), P(ob), I64(os_), P(w), I32(d), F32(eps), F32(off)])
        torch.cuda.synchronize()
        x = xb[:, :d].float()
        ref = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * (off + w.float())
        key = f"rows={rows} d={d} x_stride={xs} out_stride={os_} offset={off} block={block}"
        r = close("rms_norm_rows " + key, ob[:, :d].float(), ref)
        if os_ > d:
            r["padding_untouched"] = exact("rms_norm_rows padding " + key, bool(torch.isnan(ob[:, d:].float()).all()))
        res[key] = r
    report["rms_norm_rows"] = res


# ------------------------------------------------------------------------------------------------
# RMSNorm fused into the GEMV (rms_norm_gemv*, rms_prologue.cuh)
# ------------------------------------------------------------------------------------------------
NORM_GEMV_MAX_SMEM = 88 << 10  # crates/kiln-cuda/src/norm_gemv.rs


def norm_threads(d):
    """Block size of the unfused add_rms_norm_bf16 launch (backend.rs), which the fused kernels mirror."""
    return min(max((-(-d // 4) + 31) // 32 * 32, 128), 1024)


def test_rms_norm_gemv(gemv_mod, direct_mod, elem_mod, report, bench_too=True):
    """Fused norm + GEMV against torch (norm rounded to bf16, then the product) and against the unfused
    kernels (add_rms_norm_bf16, then the plain GEMV), which it should equal bit for bit; timings of
    the fused kernel next to the two it replaces (single launches, L2 flushed before each)."""
    torch.manual_seed(7)
    cu = direct_mod.cuda.cu
    cu.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    for M in range(1, 9):
        direct_mod.cuda.check(cu.cuFuncSetAttribute(direct_mod.fn(f"rms_norm_gemv_direct_bf16_m{M}"), 8,
                                                    NORM_GEMV_MAX_SMEM), "cuFuncSetAttribute")
    res, times = {}, {}
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda") if bench_too else None
    cases = [(6144, 4096, 0), (2048, 1536, 1), (1000, 584, 0), (1000, 584, 1), (14336, 4096, 3),
             (14336, 4096, 4), (500, 584, 3), (500, 584, 4), (49152, 4096, 0)]
    eps = 1e-5
    for (N, K, mode) in cases:
        rows = 2 * N if mode >= 3 else N
        w = (torch.randn(rows, K, device="cuda") / math.sqrt(K)).to(torch.bfloat16)
        bias = torch.randn(N, device="cuda").to(torch.bfloat16) if mode == 1 else None
        nt = norm_threads(K)
        for off in (0.0, 1.0):
            nw = (torch.randn(K, device="cuda") * 0.1 + (0.0 if off else 1.0)).to(torch.bfloat16)
            for M in range(1, 9):
                if N == 49152 and (off or M not in (1, 8)):
                    continue
                x = (torch.randn(M, K, device="cuda") * 3).to(torch.bfloat16)
                out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                h = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
                ref_out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                smem = M * (2 * K + 64)

                def fused(cols=None):
                    c, md = direct_tiles(N, mode)
                    if cols is not None and mode <= 2:
                        c, md = cols, (mode | 8 if cols == 8 else mode)
                    direct_mod.launch(f"rms_norm_gemv_direct_bf16_m{M}", (direct_grid(N, c),), (256,),
                                      [P(x), P(nw), P(w), P(out), P(bias), I32(N), I32(K), I32(md), F32(eps),
                                       F32(off), I32(nt)], smem=smem)

                def norm():
                    elem_mod.launch("add_rms_norm_bf16", (M,), (nt,),
                                    [P(x), P(None), P(nw), P(h), I32(K), F32(eps), F32(off)])

                def gemv():
                    run_old(direct_mod, M, h, w, ref_out, bias, N, K, mode)

                fused()
                norm()
                gemv()
                torch.cuda.synchronize()
                xf = x.float()
                hr = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps) * (off + nw.float())).to(torch.bfloat16)
                ref = gemv_ref(hr, w, bias, N, mode)
                key = f"M={M} N={N} K={K} mode={mode} offset={off}"
                r = close("rms_norm_gemv " + key, out.float(), ref)
                same = torch.equal(out, ref_out)
                r["bit_exact_vs_unfused_kernels"] = same
                if not same:
                    nd = int((out != ref_out).sum())
                    r["n_diff_vs_unfused"] = nd
                    print(f"NOTE rms_norm_gemv {key}: {nd}/{out.numel()} outputs differ from the unfused kernels")
                res[key] = r
                if mode <= 2 and M in (1, 3, 8):  # the other tile width than the host rule's
                    other = 24 - direct_tiles(N, mode)[0]
                    out.fill_(float("nan"))
                    fused(other)
                    torch.cuda.synchronize()
                    res[key + f" cols={other}"] = close(f"rms_norm_gemv {key} cols={other}", out.float(), ref)
                if bench_too and off == 0.0 and M in (1, 2, 4, 8):
                    t = {"fused_us": time_fn(fused, flush=flush) * 1e6, "norm_us": time_fn(norm, flush=flush) * 1e6,
                         "gemv_us": time_fn(gemv, flush=flush) * 1e6}
                    t["saved_us"] = t["norm_us"] + t["gemv_us"] - t["fused_us"]
                    times[key] = t
                    print(f"rms_norm_gemv {key:40s} fused {t['fused_us']:7.1f} us | norm {t['norm_us']:6.1f} + "
                          f"gemv {t['gemv_us']:7.1f} us")
        del w
        torch.cuda.empty_cache()
    report["rms_norm_gemv"] = res
    if bench_too:
        report["rms_norm_gemv_bench"] = times


# ------------------------------------------------------------------------------------------------
# Skinny GEMM (skinny.cu): 9..64 rows
# ------------------------------------------------------------------------------------------------
SK_CNT = None  # u32 tile counters of split-K launches, zero between launches
SK_CNT_LEN = 16384  # crates/kiln-cuda/src/skinny.rs COUNTERS


def skinny_smem(mt):
    return 4 * (1024 + 8 * mt) * 16


def skinny_launch(M, N, K, gated, num_sms=None):
    """The host rule of crates/kiln-cuda/src/skinny.rs (launch_shape), verbatim: (mt, tiles, splits)."""
    num_sms = num_sms or NUM_SMS
    mt = -(-M // 16) * 16
    tiles = -(-N // (64 if gated else 128))
    chunks = -(-K // 64)
    splits = 1 if tiles > SK_CNT_LEN else min(max(-(-num_sms // tiles), 1), max(chunks // 8, 1))
    return mt, tiles, splits


def skinny_prepare(mod):
    cu = mod.cuda.cu
    cu.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    for mt in (16, 32, 48, 64):
        f = mod.fn(f"skinny_gemm_bf16_m{mt}")
        mod.cuda.check(cu.cuFuncSetAttribute(f, 8, skinny_smem(64)), "cuFuncSetAttribute(max dynamic smem)")
        mod.cuda.check(cu.cuFuncSetAttribute(f, 9, 100), "cuFuncSetAttribute(carveout)")


def skinny_ws(M, N, K, mode, splits=None):
    mt, tiles, sp = skinny_launch(M, N, K, mode >= 3)
    sp = splits or sp
    return torch.empty(max(tiles * sp * mt * 128, 1), device="cuda", dtype=torch.float32) if sp > 1 else None


def run_skinny(mod, M, x, w, out, extra, N, K, mode, splits=None, ws=None):
    """splits None: the host rule. ws: partial sums of a split launch (allocated here if None)."""
    mt, tiles, sp = skinny_launch(M, N, K, mode >= 3)
    sp = splits or sp
    if sp > 1 and ws is None:
        ws = skinny_ws(M, N, K, mode, sp)
    mod.launch(f"skinny_gemm_bf16_m{mt}", (tiles, sp), (128,),
               [P(x), P(w), P(out), P(extra), I32(M), I32(N), I32(K), I32(mode), P(ws if sp > 1 else None),
                P(SK_CNT if sp > 1 else None)], smem=skinny_smem(mt))


def test_skinny(mod, report, bench_too=True):
    """Correctness of every mode at M = 9..64 (odd N, K not a multiple of 64, split and unsplit K, the
    residual aliased with the output), determinism, counters left zero; then weight bandwidth on the
    8B decode shapes at M = 16, 32, 64 next to torch.matmul (cuBLAS) and a sweep of the split count."""
    global SK_CNT
    torch.manual_seed(9)
    skinny_prepare(mod)
    SK_CNT = torch.zeros(SK_CNT_LEN, device="cuda", dtype=torch.int32)
    res = {}
    plain = [(6144, 4096), (4096, 4096), (4096, 14336), (1001, 1000), (515, 2048), (259, 3000), (1537, 576), (24, 8)]
    gated = [(14336, 4096), (501, 1000), (769, 576), (130, 14336)]
    cases = [(N, K, mode) for (N, K) in plain for mode in (0, 1, 2)] + \
            [(N, K, mode) for (N, K) in gated for mode in (3, 4)]
    for (N, K, mode) in cases:
        rows = 2 * N if mode >= 3 else N
        w = (torch.randn(rows, K, device="cuda") / math.sqrt(K)).to(torch.bfloat16)
        big = N * K >= 4096 * 4096
        for M in (9, 16, 17, 31, 32, 48, 63, 64):
            if big and M not in (9, 32, 63, 64):
                continue
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            pad = 256
            buf = torch.full((M * N + pad,), float("nan"), device="cuda", dtype=torch.bfloat16)
            out = buf[: M * N].view(M, N)
            extra = None
            if mode == 1:
                extra = torch.randn(N, device="cuda").to(torch.bfloat16)
            if mode == 2:
                extra = torch.randn(M, N, device="cuda").to(torch.bfloat16)
            ref = gemv_ref(x, w, extra, N, mode)
            _, tiles, rule = skinny_launch(M, N, K, mode >= 3)
            chunks = -(-K // 64)
            splits = sorted({rule, 1, min(3, chunks), chunks})
            for sp in splits:
                for alias in ([False, True] if mode == 2 else [False]):
                    buf.fill_(float("nan"))
                    ex = extra
                    if alias:
                        out.copy_(extra)
                        ex = out
                    run_skinny(mod, M, x, w, out, ex, N, K, mode, splits=sp)
                    torch.cuda.synchronize()
                    name = f"skinny M={M} N={N} K={K} mode={mode} splits={sp}" + (" alias" if alias else "") + \
                           (" (rule)" if sp == rule else "")
                    r = close(name, out.float(), ref)
                    r["tail_untouched"] = exact(name + " tail", bool(torch.isnan(buf[M * N:].float()).all()))["ok"]
                    r["counters_zero_after"] = exact(name + " counters zero after", bool((SK_CNT == 0).all()))["ok"]
                    if not r["counters_zero_after"]:
                        SK_CNT.zero_()
                    if not alias:
                        first = out.clone()
                        run_skinny(mod, M, x, w, out, ex, N, K, mode, splits=sp)
                        torch.cuda.synchronize()
                        r["deterministic"] = exact(name + " deterministic", torch.equal(first, out))["ok"]
                    res[name] = r
        del w
        torch.cuda.empty_cache()
    n_ok = sum(1 for r in res.values() if r["ok"] and r["tail_untouched"] and r["counters_zero_after"]
               and r.get("deterministic", True))
    print(f"skinny: {n_ok}/{len(res)} cases ok")
    report["skinny"] = res
    if not bench_too:
        return
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    t_copy = time_fn(lambda: big.clone(), iters=20, warmup=3)
    copy_gbs = 2 * big.numel() / t_copy / 1e9
    del big
    torch.cuda.empty_cache()
    clean_src = torch.ones(128 << 20, dtype=torch.float32, device="cuda")

    class ReadFlush:  # L2 full of clean lines: read 512 MiB
        def zero_(self):
            clean_src.sum()
    rflush = ReadFlush()
    occ = {f"m{mt}": mod.occupancy(f"skinny_gemm_bf16_m{mt}", block=128, smem=skinny_smem(mt)) for mt in (16, 32, 48, 64)}
    out_b = {"copy_GBps": copy_gbs, "num_sms": NUM_SMS, "occupancy_blocks_per_sm": occ, "cases": {}}
    print(f"skinny occupancy (blocks/SM): {occ}; d2d copy {copy_gbs:.0f} GB/s")
    shapes = [("qkv 6144x4096", 6144, 4096, 0), ("o 4096x4096 +res", 4096, 4096, 2),
              ("gate_up 2x14336x4096 silu", 14336, 4096, 3), ("down 4096x14336 +res", 4096, 14336, 2),
              ("lm_head 49152x4096", 49152, 4096, 0)]
    for (label, N, K, mode) in shapes:
        rows = 2 * N if mode >= 3 else N
        w = (torch.randn(rows, K, device="cuda") / math.sqrt(K)).to(torch.bfloat16)
        wbytes = w.numel() * 2
        for M in (16, 32, 64):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            o = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            extra = torch.randn(M, N, device="cuda").to(torch.bfloat16) if mode == 2 else None
            mt, tiles, rule = skinny_launch(M, N, K, mode >= 3)
            chunks = -(-K // 64)
            r = {"N": N, "K": K, "M": M, "mode": mode, "weight_MB": wbytes / 1e6, "tiles": tiles, "rule_splits": rule}
            cfgs = [(f"splits={sp}" + (" (rule)" if sp == rule else ""),
                     (lambda sp, ws: lambda: run_skinny(mod, M, x, w, o, extra, N, K, mode, splits=sp, ws=ws))(
                         sp, skinny_ws(M, N, K, mode, sp)))
                    for sp in sorted({rule, 1, 2, 3, 4, 6, 8}) if sp <= chunks]
            if mode == 2:
                cfgs.append(("cublas addmm", lambda: torch.addmm(extra, x, w.t())))
            else:
                cfgs.append(("cublas matmul", lambda: torch.matmul(x, w.t())))
            print(f"skinny {label:26s} M={M} tiles={tiles} rule splits={rule} (us, GB/s of weights, % of copy: "
                  f"write-flush | clean-flush)")
            for cn, fn in cfgs:
                tw = time_fn(fn, flush=flush)
                tc = time_fn(fn, flush=rflush)
                q = {"write_flush_us": tw * 1e6, "clean_flush_us": tc * 1e6, "write_flush_GBps": wbytes / tw / 1e9,
                     "clean_flush_GBps": wbytes / tc / 1e9}
                r[cn] = q
                print(f"    {cn:20s} {q['write_flush_us']:7.1f} {q['write_flush_GBps']:6.0f} "
                      f"{100 * q['write_flush_GBps'] / copy_gbs:5.1f}% | {q['clean_flush_us']:7.1f} "
                      f"{q['clean_flush_GBps']:6.0f} {100 * q['clean_flush_GBps'] / copy_gbs:5.1f}%")
            rk = next(v for k, v in r.items() if k.endswith("(rule)"))
            cb = r.get("cublas matmul") or r.get("cublas addmm")
            r["speedup_vs_cublas_clean"] = cb["clean_flush_us"] / rk["clean_flush_us"]
            out_b["cases"][f"{label} M={M}"] = r
        del w
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    out_b["counters_zero_after_bench"] = exact("skinny counters zero after bench", bool((SK_CNT == 0).all()))["ok"]
    report["skinny_bench"] = out_b


# ------------------------------------------------------------------------------------------------
# timings
# ------------------------------------------------------------------------------------------------
def time_fn(fn, iters=50, warmup=5, flush=None):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    times.sort()
    return times[len(times) // 2]


def time_b2b(fn, ws_, n=24, reps=7):
    """Per-launch time of n launches back to back, rotating over distinct weight copies (decode-like)."""
    for i in range(4):
        fn(ws_[i % len(ws_)])
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n):
            fn(ws_[i % len(ws_)])
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3 / n)
    times.sort()
    return times[len(times) // 2]


def direct_tiles(N, mode, sms=None):
    """The host rule of crates/kiln-cuda/src/gemv.rs (direct_tiles), verbatim: (tile width, mode argument)."""
    if mode >= 3:
        return 8, mode
    slots = max(1, (sms or NUM_SMS) * 2)
    fill = lambda b: b / (-(-b // slots) * slots)
    if fill(-(-N // 8)) > fill(-(-N // 16)) + 0.05:
        return 8, mode | 8
    return 16, mode


def direct_grid(N, cols, sms=None):
    """The backend's grid for the direct-load GEMV (gemv.rs direct_launch): at most one wave of 2 blocks per SM."""
    return min(-(-N // cols), 2 * (sms or NUM_SMS))


def run_old(old, M, x, w, out, extra, N, K, mode):
    """The direct-load GEMV (gemv_direct.cu) as the backend launches it."""
    c, md = direct_tiles(N, mode)
    old.launch(f"gemv_direct_bf16_m{M}", (direct_grid(N, c),), (256,), [P(x), P(w), P(out), P(extra), I32(N), I32(K),
                                                                     I32(md)])


def bench(mod, report, variants=(), old=None):
    torch.manual_seed(6)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    big.random_(0, 255)
    t_copy = time_fn(lambda: big.clone(), iters=20, warmup=3)
    copy_gbs = 2 * big.numel() / t_copy / 1e9
    del big
    torch.cuda.empty_cache()
    print(f"d2d copy (clone 1 GiB, read+write): {copy_gbs:.0f} GB/s")
    out = {"copy_GBps": copy_gbs, "copy_s": t_copy, "num_sms": NUM_SMS, "cases": {},
           "occupancy_blocks_per_sm": {f"m{M}": mod.occupancy(f"gemv_bf16_m{M}") for M in (1, 8)}}
    print(f"gemv occupancy (blocks/SM): {out['occupancy_blocks_per_sm']}, SMs: {NUM_SMS}")
    clean_src = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    clean_src.fill_(1)

    class ReadFlush:  # L2 full of clean lines: read 512 MiB
        def zero_(self):
            clean_src.view(torch.float32).sum()
    rflush = ReadFlush()
    # launch floor: a 16 x 8 GEMV (one block) timed the same ways
    tiny_w = torch.zeros(16, 8, device="cuda", dtype=torch.bfloat16)
    tiny_x = torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16)
    tiny_o = torch.empty(1, 16, device="cuda", dtype=torch.bfloat16)
    tf = lambda ww: run_gemv(mod, 1, tiny_x, ww, tiny_o, None, 16, 8, 0)
    out["launch_floor_us"] = {"write_flush": time_fn(lambda: tf(tiny_w), flush=flush) * 1e6,
                              "clean_flush": time_fn(lambda: tf(tiny_w), flush=rflush) * 1e6,
                              "warm": time_fn(lambda: tf(tiny_w)) * 1e6, "b2b": time_b2b(tf, [tiny_w]) * 1e6}
    print("launch floor (1-block GEMV), us: " + ", ".join(f"{k} {v:.2f}" for k, v in out["launch_floor_us"].items()))
    shapes = [("qkv 6144x4096", 6144, 4096, 0), ("o 4096x4096 +res", 4096, 4096, 2),
              ("gate_up 2x14336x4096 silu", 14336, 4096, 3), ("down 4096x14336 +res", 4096, 14336, 2),
              ("lm_head-ish 49152x4096", 49152, 4096, 0)]
    for (label, N, K, mode) in shapes:
        rows = 2 * N if mode >= 3 else N
        w = (torch.randn(rows, K, device="cuda") / math.sqrt(K)).to(torch.bfloat16)
        wbytes = w.numel() * 2
        for M in (1, 8):
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            o = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            extra = torch.randn(M, N, device="cuda").to(torch.bfloat16) if mode == 2 else None
            splits, grid = gemv_launch(N, K, M, mode)
            tiles = (N + 15) // 16
            # distinct weight copies for back-to-back launches: > 2 L2s of weights in rotation
            ncopy = max(1, -(-(160 << 20) // wbytes))
            ws_ = [w] + [w.clone() for _ in range(ncopy - 1)]
            cfgs = [("rule", lambda ww: run_gemv(mod, M, x, ww, o, extra, N, K, mode)),
                    ("old", lambda ww: run_old(old, M, x, ww, o, extra, N, K, mode)),
                    ("s1_grid528", lambda ww: run_gemv(mod, M, x, ww, o, extra, N, K, mode, 1, min(tiles, 4 * NUM_SMS))),
                    ("s2_grid264", lambda ww: run_gemv(mod, M, x, ww, o, extra, N, K, mode, 2, 2 * NUM_SMS)),
                    ("s2_grid528", lambda ww: run_gemv(mod, M, x, ww, o, extra, N, K, mode, 2, 4 * NUM_SMS)),
                    ("cublas", lambda ww: torch.matmul(x, ww.t()))]
            cfgs += [(vn, (lambda vm: lambda ww: run_gemv(vm, M, x, ww, o, extra, N, K, mode))(vm)) for vn, vm in variants]
            pc = lambda t: 100 * wbytes / t / 1e9 / copy_gbs
            r = {"N": N, "K": K, "M": M, "mode": mode, "weight_MB": wbytes / 1e6, "splits": splits, "grid": grid,
                 "copies_b2b": ncopy}
            for cn, fn in cfgs:
                if cn == "old" and old is None:
                    continue
                tw = time_fn(lambda: fn(w), flush=flush)
                tc = time_fn(lambda: fn(w), flush=rflush)
                tb = time_b2b(fn, ws_)
                r[cn] = {"write_flush_us": tw * 1e6, "clean_flush_us": tc * 1e6, "b2b_us": tb * 1e6,
                         "write_flush_pct": pc(tw), "clean_flush_pct": pc(tc), "b2b_pct": pc(tb)}
            r["kiln_us"] = r["rule"]["write_flush_us"]
            r["kiln_frac_of_copy"] = r["rule"]["write_flush_pct"] / 100
            out["cases"][f"{label} M={M}"] = r
            print(f"{label:26s} M={M} splits={splits} grid={grid} (us, % of copy: write-flush | clean-flush | back-to-back)")
            for cn, _ in cfgs:
                if cn in r:
                    q = r[cn]
                    print(f"    {cn:26s} {q['write_flush_us']:6.1f} {q['write_flush_pct']:5.1f}% | "
                          f"{q['clean_flush_us']:6.1f} {q['clean_flush_pct']:5.1f}% | {q['b2b_us']:6.1f} {q['b2b_pct']:5.1f}%")
            del ws_
        del w
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    out["ws_zero_after_bench"] = exact("gemv ws/counters zero after bench", ws_zero())["ok"]
    report["bench"] = out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemv_check.json")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "tolerance": "|kiln - ref| <= 1e-2 + 1e-2 * |ref| (bf16 outputs); logprob 1e-4 + 1e-5 * |ref|"}
    cuda = Cuda()
    report["nvrtc"] = cuda.nvrtc_path
    global NUM_SMS, WS, CNT
    NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count
    WS = torch.zeros(WS_FLOATS, device="cuda", dtype=torch.float32)  # once, reused by every launch
    CNT = torch.zeros(CNT_LEN, device="cuda", dtype=torch.int32)
    mods = {}
    for name in ["gemv", "fused", "gemv_direct", "elementwise", "skinny"]:
        t0 = time.time()
        mods[name], how = cuda.load(os.path.join(KDIR, name + ".cu"))
        report[f"{name}_module"] = {"how": how, "compile_load_s": time.time() - t0}
    steps = [("gemv", lambda: test_gemv(mods["gemv"], report)), ("argmax", lambda: test_argmax(mods["gemv"], report)),
             ("qkv_rope", lambda: test_qkv_rope(mods["fused"], report)),
             ("gated_act", lambda: test_gated_act(mods["fused"], report)),
             ("bias_residual", lambda: test_bias_residual(mods["fused"], report)),
             ("rms_norm_rows", lambda: test_rms_norm_rows(mods["fused"], report)),
             ("rms_norm_gemv", lambda: test_rms_norm_gemv(mods["gemv"], mods["gemv_direct"], mods["elementwise"], report,
                                                          bench_too=not args.no_bench)),
             ("skinny", lambda: test_skinny(mods["skinny"], report, bench_too=not args.no_bench))]
    if not args.no_bench:
        variants = []
        for defs in [("KILN_GEMV_MAX_STAGES=3",), ("KILN_GEMV_MAX_STAGES=2",)]:
            try:
                variants.append((" ".join(defs), cuda.load(os.path.join(KDIR, "gemv.cu"), defs)[0]))
            except Exception as e:
                print(f"variant {defs} failed: {e!r}")
        old = None
        try:  # the direct-load kernel (gemv_direct.cu), timed next to the pipelined one
            old = cuda.load(os.path.join(KDIR, "gemv_direct.cu"))[0]
        except Exception as e:
            print(f"baseline kernel failed: {e!r}")
        steps.append(("bench", lambda: bench(mods["gemv"], report, variants, old)))
    for name, step in steps:
        n_fail = len(FAILS)
        try:
            step()
            print(f"[{name}] {'ok' if len(FAILS) == n_fail else f'{len(FAILS) - n_fail} failures'}")
        except Exception as e:  # keep going; record the error
            import traceback
            traceback.print_exc()
            FAILS.append(f"{name}: exception {e!r}")
            report[f"{name}_error"] = repr(e)
            if "launch" in repr(e).lower() or "illegal" in repr(e).lower():
                break  # the context is likely dead
    report["failures"] = FAILS
    report["ok"] = not FAILS
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{'OK' if not FAILS else 'FAILED'}: {len(FAILS)} failures; report in {args.out}")
    for x in FAILS[:30]:
        print("  ", x)
    sys.exit(0 if not FAILS else 1)


if __name__ == "__main__":
    main()
