#!/usr/bin/env python3
"""Standalone correctness + speed check of Kiln's CUDA C kernels (crates/kiln-cuda/src/kernels/*.cu).

Compiles a .cu file with NVRTC (through ctypes, `#include "common.cuh"` expanded here), loads it with
the CUDA driver API into torch's context and launches its kernels on torch's current stream, comparing
against PyTorch float32 references.

    python3 bench/gpu/kernel_check.py [--out kernel_check.json] [--only flash] [--no-bench]
        [--cuda-home /usr/local/cuda-13.0] [-D NAME=VALUE ...]

Tolerance: max |kernel - ref| <= 2e-2 (absolute), where ref is the float32 reference rounded to bf16
and kernel is the kernel's bf16 output.  Exit status 1 if any correctness check fails.

Adding tests: write a function `def test_xxx(ctx)` that uses `load_module(cu_file)`, `launch(...)`, and
`ctx.check(name, got, ref, **info)` / `ctx.bench(name, fn, **info)`, and decorate it with
`@register("group")`.  Launch arguments are a list of ctypes values (c_int32 for int, c_int64 for
long long, c_float for float) or torch tensors (passed as their data_ptr()) or None (null pointer).
"""
import argparse, ctypes, glob, json, math, os, re, sys, time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
KDIR = os.path.join(REPO, "crates", "kiln-cuda", "src", "kernels")
TOL = 2e-2

# ----------------------------------------------------------------------------------------------------
# NVRTC + driver API through ctypes
# ----------------------------------------------------------------------------------------------------
_nvrtc = None
_cuda = None
_cuda_home = "/usr/local/cuda-13.0"
_defines = []
_modules = {}


def _find_lib(names, dirs):
    for d in dirs:
        for n in names:
            for p in sorted(glob.glob(os.path.join(d, n)), reverse=True):
                try:
                    return ctypes.CDLL(p)
                except OSError:
                    pass
    for n in names:
        try:
            return ctypes.CDLL(n.replace("*", ""))
        except OSError:
            pass
    raise RuntimeError(f"cannot load any of {names} from {dirs}")


def _libs():
    global _nvrtc, _cuda
    if _nvrtc is None:
        dirs = [os.path.join(_cuda_home, "lib64"), os.path.join(_cuda_home, "lib"),
                os.path.join(_cuda_home, "targets", "x86_64-linux", "lib")]
        try:
            import nvidia  # pip wheels shipped with torch
            for p in nvidia.__path__:
                dirs += glob.glob(os.path.join(p, "*", "lib"))
        except ImportError:
            pass
        _nvrtc = _find_lib(["libnvrtc.so", "libnvrtc.so.*"], dirs)
        _cuda = _find_lib(["libcuda.so.1", "libcuda.so"], ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"])
        _cuda.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return _nvrtc, _cuda


def _cu(rc, what):
    if rc != 0:
        s = ctypes.c_char_p()
        _cuda.cuGetErrorString(rc, ctypes.byref(s))
        raise RuntimeError(f"{what}: CUDA error {rc} ({s.value.decode() if s.value else '?'})")


def expand_includes(path, seen=None):
    seen = set() if seen is None else seen
    out = []
    for line in open(path).read().splitlines():
        m = re.match(r'\s*#include\s+"(.+)"', line)
        if m:
            inc = os.path.join(os.path.dirname(path), m.group(1))
            if inc not in seen:
                seen.add(inc)
                out.append(expand_includes(inc, seen).replace("#pragma once", ""))
        else:
            out.append(line)
    return "\n".join(out)


def compile_ptx(cu_file, defines=()):
    nvrtc, _ = _libs()
    src = expand_includes(cu_file).encode()
    prog = ctypes.c_void_p()
    rc = nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(cu_file).encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram {rc}"
    opts = [b"--gpu-architecture=compute_90", b"--std=c++17", b"-default-device", b"-lineinfo",
            ("-I" + os.path.join(_cuda_home, "include")).encode(),
            ("-I" + os.path.join(_cuda_home, "include", "cccl")).encode()]
    opts += [("-D" + d).encode() for d in list(_defines) + list(defines)]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    if rc != 0:
        raise RuntimeError(f"NVRTC failed on {cu_file} (rc {rc})")
    nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.raw


class Module:
    def __init__(self, cu_file, defines=()):
        _, cuda = _libs()
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # make torch's primary context current on this thread
        self.cu_file = cu_file
        self.ptx = compile_ptx(cu_file, defines)
        self.handle = ctypes.c_void_p()
        _cu(cuda.cuModuleLoadData(ctypes.byref(self.handle), ctypes.c_char_p(self.ptx)), "cuModuleLoadData")
        self.funcs = {}

    def func(self, name, dyn_smem=0):
        _, cuda = _libs()
        if name not in self.funcs:
            f = ctypes.c_void_p()
            _cu(cuda.cuModuleGetFunction(ctypes.byref(f), self.handle, name.encode()), f"cuModuleGetFunction {name}")
            self.funcs[name] = [f, 0]
        f = self.funcs[name]
        if dyn_smem > 48 * 1024 and dyn_smem > f[1]:
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
            _cu(cuda.cuFuncSetAttribute(f[0], 8, ctypes.c_int(dyn_smem)), f"cuFuncSetAttribute {name}")
            f[1] = dyn_smem
        return f[0]


def load_module(cu_file, defines=()):
    """Compile (once per file + defines) and load a kernel file; cu_file relative to the kernel dir or absolute."""
    path = cu_file if os.path.isabs(cu_file) else os.path.join(KDIR, cu_file)
    key = (path, tuple(defines))
    if key not in _modules:
        _modules[key] = Module(path, defines)
    return _modules[key]


class Launch:
    """A prepared launch of module's kernel `name` (argument block built once; call it to launch).
    args: ctypes scalars, torch tensors (-> data pointer) or None (null pointer)."""

    def __init__(self, module, name, grid, block, smem, args):
        self.f = module.func(name, smem)
        self.name = name
        vals = []
        for a in args:
            if isinstance(a, torch.Tensor):
                assert a.is_cuda
                vals.append(ctypes.c_uint64(a.data_ptr()))
            elif a is None:
                vals.append(ctypes.c_uint64(0))
            elif isinstance(a, ctypes._SimpleCData):
                vals.append(a)
            else:
                raise TypeError(f"launch arg {a!r}: use a ctypes value or a tensor")
        self.keep = (vals, [a for a in args if isinstance(a, torch.Tensor)])
        self.params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        g = tuple(grid) + (1,) * (3 - len(grid))
        b = tuple(block) + (1,) * (3 - len(block))
        self.dims = [ctypes.c_uint(x) for x in g + b] + [ctypes.c_uint(smem)]

    def __call__(self):
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _cu(_cuda.cuLaunchKernel(self.f, *self.dims, stream, self.params, None), f"cuLaunchKernel {self.name}")


def launch(module, name, grid, block, smem, args):
    """Launch module's kernel `name` once on torch's current stream (see Launch for args)."""
    Launch(module, name, grid, block, smem, args)()


def time_ms(fn, warmup=3, iters=20, reps=10):
    """Median over `iters` of (CUDA-event time of `reps` back-to-back calls) / reps, in ms. The calls are
    captured into a CUDA graph when possible so host launch overhead does not count (kernel time only)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    run = None
    try:
        graph = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        run = graph.replay
    except Exception as e:  # noqa: BLE001
        print(f"  (graph capture failed: {e}; timing direct launches)")
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    ts.sort()
    return ts[len(ts) // 2]


# ----------------------------------------------------------------------------------------------------
# Test registry
# ----------------------------------------------------------------------------------------------------
TESTS = []


def register(group):
    def deco(fn):
        TESTS.append((group, fn))
        return fn
    return deco


class Ctx:
    def __init__(self, bench):
        self.do_bench = bench
        self.checks = []
        self.benches = []

    def check(self, name, got, ref, **info):
        got = got.float()
        ref = ref.float().to(torch.bfloat16).float()
        finite = bool(torch.isfinite(got).all())
        err = float((got - ref).abs().max()) if finite else float("inf")
        ok = finite and err <= TOL
        rec = {"name": name, "max_abs_err": err, "pass": ok, **info}
        self.checks.append(rec)
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}: max abs err {err:.3e}" + ("" if finite else " (non-finite)"))
        return ok

    def bench(self, name, fn, **info):
        ms = time_ms(fn)
        rec = {"name": name, "ms": ms, **info}
        extra = ""
        if "bytes" in info:
            rec["GB_per_s"] = info["bytes"] / ms / 1e6
            extra += f", {rec['GB_per_s']:.0f} GB/s"
        if "flops" in info:
            rec["TFLOP_per_s"] = info["flops"] / ms / 1e9
            extra += f", {rec['TFLOP_per_s']:.1f} TFLOP/s"
        self.benches.append(rec)
        print(f"  [bench] {name}: {ms * 1000:.1f} us{extra}")
        return rec


# ----------------------------------------------------------------------------------------------------
# Paged-KV attention helpers (flash.cu)
# ----------------------------------------------------------------------------------------------------
I32, I64, F32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class PagedKV:
    """Random paged cache: sequences of the given lengths, blocks randomly permuted, spare blocks of noise."""

    def __init__(self, lens, kv_heads, hd, block_size=16, gen=None, spare_blocks=7):
        self.lens, self.kv_heads, self.hd, self.bs = list(lens), kv_heads, hd, block_size
        nblk = [max(1, -(-n // block_size)) for n in lens]
        total = sum(nblk) + spare_blocks
        perm = torch.randperm(total, generator=gen)
        self.table_width = max(nblk) + 1
        tables = torch.zeros(len(lens), self.table_width, dtype=torch.int64)
        o = 0
        for s, nb in enumerate(nblk):
            tables[s, :nb] = perm[o:o + nb]
            o += nb
        self.tables_cpu = tables
        self.tables = tables.to(torch.int32).cuda()  # u32 on the kernel side; values are small
        slots = total * block_size
        cg = torch.Generator(device="cuda").manual_seed(int(torch.randint(1 << 30, (1,), generator=gen)))
        self.k = torch.randn(slots, kv_heads * hd, generator=cg, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn(slots, kv_heads * hd, generator=cg, device="cuda", dtype=torch.bfloat16)

    def slots(self, s, n):
        p = torch.arange(n)
        return (self.tables_cpu[s, p // self.bs] * self.bs + p % self.bs).cuda()

    def seq_kv(self, s, n):
        sl = self.slots(s, n)
        return (self.k[sl].float().view(n, self.kv_heads, self.hd), self.v[sl].float().view(n, self.kv_heads, self.hd))


def ref_attention(qrows, pos, seq, kv, heads, scale, window, softcap, chunk=1024):
    """qrows [R, heads, hd] f32; pos/seq lists; returns [R, heads, hd] f32."""
    R = qrows.shape[0]
    out = torch.zeros_like(qrows)
    G = heads // kv.kv_heads
    by_seq = {}
    for r in range(R):
        by_seq.setdefault(seq[r], []).append(r)
    for s, rows in by_seq.items():
        n = max(pos[r] for r in rows) + 1
        K, V = kv.seq_kv(s, n)
        K = K.repeat_interleave(G, dim=1)  # [n, heads, hd]
        V = V.repeat_interleave(G, dim=1)
        for c in range(0, len(rows), chunk):
            rr = torch.tensor(rows[c:c + chunk], device="cuda")
            pp = torch.tensor([pos[r] for r in rows[c:c + chunk]], device="cuda")
            qq = qrows[rr]  # [r, heads, hd]
            sc = torch.einsum("rhd,khd->hrk", qq, K) * scale
            if softcap > 0:
                sc = torch.tanh(sc / softcap) * softcap
            keys = torch.arange(n, device="cuda")
            mask = keys[None, :] <= pp[:, None]
            if window > 0:
                mask &= keys[None, :] > (pp[:, None] - window)
            sc = sc.masked_fill(~mask[None], float("-inf"))
            pr = torch.softmax(sc, dim=-1)
            out[rr] = torch.einsum("hrk,khd->rhd", pr, V)
    return out


def make_q(rows, heads, kv_heads, hd, gen):
    """Packed qkv rows [rows, (heads + 2 kv_heads) hd]; q is the first heads*hd columns."""
    width = (heads + 2 * kv_heads) * hd
    qkv = torch.randn(rows, width, generator=gen).to(torch.bfloat16).cuda()
    return qkv, width


def u32(lst):
    return torch.tensor(lst, dtype=torch.int64).to(torch.int32).cuda()


def run_decode(mod, hd, qkv, q_stride, kv, pos, seq, heads, scale, window, softcap, partition_size, out, out_stride,
               num_parts=None, fused=False):
    """fused: the last partition combines (zeroed counters passed, no reduce kernel)."""
    rows = len(pos)
    pos_t, seq_t = (pos, seq) if isinstance(pos, torch.Tensor) else (u32(pos), u32(seq))
    if num_parts is None:
        maxlen = int(max(pos)) + 1 if not isinstance(pos, torch.Tensor) else int(pos.max()) + 1
        num_parts = 1 if partition_size <= 0 else -(-maxlen // partition_size)
    part_out = part_ml = None
    if num_parts > 1:
        part_out = torch.empty(rows * heads * num_parts * hd, dtype=torch.float32, device="cuda")
        part_ml = torch.empty(rows * heads * num_parts * 2, dtype=torch.float32, device="cuda")
    counters = torch.zeros(rows * kv.kv_heads, dtype=torch.int32, device="cuda") if fused and num_parts > 1 else None

    main = Launch(mod, f"decode_attention_hd{hd}", (rows, kv.kv_heads, num_parts), (128,), 0,
                  [qkv, I64(q_stride), kv.k, kv.v, pos_t, seq_t, kv.tables, I32(kv.table_width), I32(kv.bs),
                   I32(heads), I32(kv.kv_heads), F32(scale), I32(window), F32(softcap), I32(partition_size),
                   part_out, part_ml, counters, out, I64(out_stride)])
    red = None
    if num_parts > 1 and counters is None:
        red = Launch(mod, f"decode_attention_reduce_hd{hd}", (rows, heads), (128,), 0,
                     [part_out, part_ml, I32(heads), I32(num_parts), out, I64(out_stride)])

    def go():
        main()
        if red is not None:
            red()
    go()
    return go, num_parts


# flash_prefill launch rule (see the top of flash.cu): block 128 threads, tiles of <= FA_TILE_ROWS rows,
# grid (num_tiles, heads), dynamic shared memory prefill_smem(hd) bytes.
FA_TILE_ROWS = 128


def prefill_smem(hd):
    return 768 * (hd + 8) + 512


def run_prefill(mod, hd, qkv, q_stride, kv, pos, seq, tiles, heads, scale, window, softcap, out, out_stride):
    pos_t, seq_t = u32(pos), u32(seq)
    tiles_t = u32([x for t in tiles for x in t])

    go = Launch(mod, f"flash_prefill_hd{hd}", (len(tiles), heads), (128,), prefill_smem(hd),
                [qkv, I64(q_stride), kv.k, kv.v, pos_t, seq_t, kv.tables, I32(kv.table_width), I32(kv.bs), tiles_t,
                 I32(heads), I32(kv.kv_heads), F32(scale), I32(window), F32(softcap), out, I64(out_stride)])
    go()
    return go


SHAPES = [(64, 9, 3), (128, 32, 8), (256, 4, 1)]  # (head_dim, heads, kv_heads)
VARIANTS = [(0, 0.0), (48, 0.0), (0, 30.0), (48, 30.0)]  # (window, softcap)


@register("flash")
def test_flash_decode(ctx):
    mod = load_module("flash.cu")
    gen = torch.Generator().manual_seed(1)
    lens = [1, 17, 512, 3000]
    for hd, heads, kvh in SHAPES:
        kv = PagedKV(lens, kvh, hd, 16, gen)
        qkv, width = make_q(len(lens), heads, kvh, hd, gen)
        pos = [n - 1 for n in lens]
        seq = list(range(len(lens)))
        scale = 1.0 / math.sqrt(hd)
        qf = qkv[:, :heads * hd].float().view(len(lens), heads, hd)
        out_stride = heads * hd + 64  # padded output rows: the padding must stay untouched
        for window, softcap in VARIANTS:
            ref = ref_attention(qf, pos, seq, kv, heads, scale, window, softcap)
            for psize, fused in [(0, False), (512, False), (100, False), (512, True), (32, True)]:
                out = torch.full((len(lens), out_stride), 7.0, dtype=torch.bfloat16, device="cuda")
                _, nparts = run_decode(mod, hd, qkv, width, kv, pos, seq, heads, scale, window, softcap, psize, out,
                                       out_stride, fused=fused)
                torch.cuda.synchronize()
                got = out[:, :heads * hd].view(len(lens), heads, hd)
                name = (f"decode hd{hd} h{heads}/{kvh} lens{lens} win{window} cap{softcap} parts{nparts}"
                        + (" fused" if fused else ""))
                ctx.check(name, got, ref)
                ctx.check(name + " (padding untouched)", out[:, heads * hd:], torch.full_like(out[:, heads * hd:], 7.0))
    # a group larger than the per-pass head count, and block_size 1 / 5
    for hd, heads, kvh, bs in [(128, 16, 1, 5), (64, 12, 2, 1)]:
        lens2 = [33, 700]
        kv = PagedKV(lens2, kvh, hd, bs, gen)
        qkv, width = make_q(2, heads, kvh, hd, gen)
        pos, seq = [n - 1 for n in lens2], [0, 1]
        qf = qkv[:, :heads * hd].float().view(2, heads, hd)
        ref = ref_attention(qf, pos, seq, kv, heads, 1.0 / math.sqrt(hd), 0, 0.0)
        for psize in [0, 128]:
            out = torch.zeros(2, heads * hd, dtype=torch.bfloat16, device="cuda")
            _, nparts = run_decode(mod, hd, qkv, width, kv, pos, seq, heads, 1.0 / math.sqrt(hd), 0, 0.0, psize, out,
                                   heads * hd)
            torch.cuda.synchronize()
            ctx.check(f"decode hd{hd} h{heads}/{kvh} block_size{bs} parts{nparts}", out.view(2, heads, hd), ref)


def tiles_for(first_row, n, sizes):
    tiles, r, i = [], 0, 0
    while r < n:
        t = min(sizes[i % len(sizes)], n - r)
        tiles.append((first_row + r, t))
        r += t
        i += 1
    return tiles


@register("flash")
def test_flash_prefill(ctx):
    mod = load_module("flash.cu")
    gen = torch.Generator().manual_seed(2)
    for hd, heads, kvh in SHAPES:
        # seq 0: fresh 4096 tokens (tiles of FA_TILE_ROWS); seq 1: chunked prefill, prefix 300 cached, 200 new rows in
        # odd tiles (37, 128, 35); seq 2: a single-token prompt; seq 3: prefix 1000, 64 new rows in tiles of 1..
        specs = [(0, 4096, [FA_TILE_ROWS]), (300, 200, [37, FA_TILE_ROWS]), (0, 1, [64]), (1000, 70, [1, 5, 64])]
        lens = [start + n for start, n, _ in specs]
        kv = PagedKV(lens, kvh, hd, 16, gen)
        pos, seq, tiles = [], [], []
        for s, (start, n, sizes) in enumerate(specs):
            tiles += tiles_for(len(pos), n, sizes)
            pos += list(range(start, start + n))
            seq += [s] * n
        R = len(pos)
        qkv, width = make_q(R, heads, kvh, hd, gen)
        qf = qkv[:, :heads * hd].float().view(R, heads, hd)
        scale = 1.0 / math.sqrt(hd)
        for window, softcap in VARIANTS:
            ref = ref_attention(qf, pos, seq, kv, heads, scale, window, softcap)
            out = torch.full((R, heads * hd), 7.0, dtype=torch.bfloat16, device="cuda")
            run_prefill(mod, hd, qkv, width, kv, pos, seq, tiles, heads, scale, window, softcap, out, heads * hd)
            torch.cuda.synchronize()
            got = out.view(R, heads, hd)
            ctx.check(f"prefill hd{hd} h{heads}/{kvh} {len(tiles)} tiles win{window} cap{softcap}", got, ref)
    # block_size 1 and 7 (key-by-key gather), GQA group 16
    for bs in [1, 7]:
        hd, heads, kvh = 128, 16, 1
        specs = [(0, 150, [FA_TILE_ROWS]), (77, 90, [37, 64])]
        lens = [a + b for a, b, _ in specs]
        kv = PagedKV(lens, kvh, hd, bs, gen)
        pos, seq, tiles = [], [], []
        for s, (start, n, sizes) in enumerate(specs):
            tiles += tiles_for(len(pos), n, sizes)
            pos += list(range(start, start + n))
            seq += [s] * n
        R = len(pos)
        qkv, width = make_q(R, heads, kvh, hd, gen)
        qf = qkv[:, :heads * hd].float().view(R, heads, hd)
        ref = ref_attention(qf, pos, seq, kv, heads, 1 / math.sqrt(hd), 0, 0.0)
        out = torch.full((R, heads * hd), 7.0, dtype=torch.bfloat16, device="cuda")
        run_prefill(mod, hd, qkv, width, kv, pos, seq, tiles, heads, 1 / math.sqrt(hd), 0, 0.0, out, heads * hd)
        torch.cuda.synchronize()
        ctx.check(f"prefill hd{hd} h{heads}/{kvh} block_size{bs}", out.view(R, heads, hd), ref)


@register("flash")
def bench_flash(ctx):
    if not ctx.do_bench:
        return
    mod = load_module("flash.cu")
    gen = torch.Generator().manual_seed(3)
    hd, heads, kvh, bs = 128, 32, 8, 16
    scale = 1 / math.sqrt(hd)
    # decode
    for batch, ctxlen in [(1, 512), (1, 4096), (64, 512), (64, 4096)]:
        kv = PagedKV([ctxlen] * batch, kvh, hd, bs, gen, spare_blocks=0)
        qkv, width = make_q(batch, heads, kvh, hd, gen)
        pos, seq = u32([ctxlen - 1] * batch), u32(list(range(batch)))
        out = torch.empty(batch, heads * hd, dtype=torch.bfloat16, device="cuda")
        kv_bytes = 2 * batch * ctxlen * kvh * hd * 2
        for psize in [0, 512, 256, 128, 64]:
            if psize >= ctxlen:
                continue
            go, nparts = run_decode(mod, hd, qkv, width, kv, pos, seq, heads, scale, 0, 0.0, psize, out, heads * hd,
                                    num_parts=1 if psize == 0 else -(-ctxlen // psize))
            ctx.bench(f"decode 8B batch{batch} ctx{ctxlen} partition{psize or 'none'} parts{nparts}", go,
                      bytes=kv_bytes, batch=batch, ctx=ctxlen, parts=nparts)
        del kv
    # prefill 4096 tokens, 8B shape
    T = 4096
    kv = PagedKV([T], kvh, hd, bs, gen, spare_blocks=0)
    qkv, width = make_q(T, heads, kvh, hd, gen)
    pos, seq = list(range(T)), [0] * T
    tiles = tiles_for(0, T, [FA_TILE_ROWS])
    tiles = tiles[::-1]  # longest tiles first (better tail balance)
    out = torch.empty(T, heads * hd, dtype=torch.bfloat16, device="cuda")
    flops = 4 * T * T / 2 * hd * heads
    go = run_prefill(mod, hd, qkv, width, kv, pos, seq, tiles, heads, scale, 0, 0.0, out, heads * hd)
    ctx.bench(f"flash_prefill 8B T{T}", go, flops=flops)
    q = torch.randn(1, heads, T, hd, generator=gen).to(torch.bfloat16).cuda()
    k = torch.randn(1, heads, T, hd, generator=gen).to(torch.bfloat16).cuda()
    v = torch.randn(1, heads, T, hd, generator=gen).to(torch.bfloat16).cuda()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ctx.bench(f"torch sdpa causal (MHA 32 heads, contiguous) T{T}", lambda: sdpa(q, k, v, is_causal=True), flops=flops)
    try:
        k8, v8 = k[:, :kvh].contiguous(), v[:, :kvh].contiguous()
        ctx.bench(f"torch sdpa causal enable_gqa (8 kv heads) T{T}",
                  lambda: sdpa(q, k8, v8, is_causal=True, enable_gqa=True), flops=flops)
    except Exception as e:  # noqa: BLE001
        print(f"  sdpa enable_gqa: {e}")


def main():
    global _cuda_home, _defines
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernel_check.json")
    ap.add_argument("--only", default=None, help="run only this test group")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--bench-only", action="store_true", help="skip correctness tests (functions named test_*)")
    ap.add_argument("--cuda-home", default=os.environ.get("CUDA_HOME", "/usr/local/cuda-13.0"))
    ap.add_argument("-D", dest="defines", action="append", default=[], help="extra NVRTC -D defines")
    args = ap.parse_args()
    _cuda_home, _defines = args.cuda_home, args.defines
    torch.set_grad_enabled(False)
    ctx = Ctx(bench=not args.no_bench)
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "tolerance_abs": TOL,
              "defines": args.defines}
    errors = []
    for group, fn in TESTS:
        if args.only and group != args.only:
            continue
        if args.bench_only and fn.__name__.startswith("test_"):
            continue
        print(f"== {group}: {fn.__name__}")
        t0 = time.time()
        try:
            fn(ctx)
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            errors.append(f"{fn.__name__}: {e}")
        print(f"   ({time.time() - t0:.1f} s)")
    report["checks"] = ctx.checks
    report["benches"] = ctx.benches
    report["errors"] = errors
    failed = [c["name"] for c in ctx.checks if not c["pass"]]
    report["failed"] = failed
    report["pass"] = not failed and not errors
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{len(ctx.checks) - len(failed)}/{len(ctx.checks)} checks passed, {len(errors)} errors; "
          f"max abs err {max([c['max_abs_err'] for c in ctx.checks] or [0]):.3e} (tolerance {TOL}); report: {args.out}")
    for n in failed:
        print("  FAILED:", n)
    for e in errors:
        print("  ERROR:", e)
    sys.exit(0 if report["pass"] else 1)


if __name__ == "__main__":
    main()
