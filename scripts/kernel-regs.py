#!/usr/bin/env python3
"""Registers, stack and spills of Kiln's CUDA kernels, without a GPU.

NVRTC (the PyPI build that scripts/install-nvrtc.sh installs) compiles a kernel source for a real
architecture with ptxas' verbose report, which gives each entry point's registers, stack frame,
spill bytes and shared memory: enough to watch occupancy while writing kernels on a CPU-only
machine. Run from the repo root:

    export KILN_CUDA_HOME=$(scripts/install-nvrtc.sh)
    python3 scripts/kernel-regs.py attention/decode.cu matmul/gemv.cu [-D KILN_DIRECT_U=3] [--arch sm_90] [--match decode]
    python3 scripts/kernel-regs.py matmul/blocks.cu -D KILN_BLOCK_FMT=9 --match qgemv   # one block format (q4_k)
"""
import argparse, ctypes, glob, os, re, sys

KDIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "kiln-cuda", "src", "ops")


def header(name):
    """A local header by name, wherever it lives under src/ops."""
    for root, _, files in os.walk(KDIR):
        if name in files:
            return os.path.join(root, name)
    sys.exit(f"no header {name} under {KDIR}")


def expand(path, seen=None):
    """The source with the kernels' local includes inlined, once each (as kiln-cuda's compile.rs does)."""
    seen = set() if seen is None else seen
    out = []
    for line in open(path).read().splitlines():
        m = re.match(r'\s*#include "(.+)"', line)
        if not m:
            out.append(line)
        elif m.group(1) not in seen:
            seen.add(m.group(1))
            out.append(expand(header(m.group(1)), seen).replace("#pragma once", ""))
    return "\n".join(out)


def nvrtc():
    home = os.environ.get("KILN_CUDA_HOME")
    if not home:
        sys.exit("set KILN_CUDA_HOME=$(scripts/install-nvrtc.sh)")
    libdir = os.path.join(home, "nvidia", "cu13", "lib")
    for b in sorted(glob.glob(os.path.join(libdir, "libnvrtc-builtins.so*"))):
        ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        break
    lib = sorted(glob.glob(os.path.join(libdir, "libnvrtc.so*")))
    if not lib:
        sys.exit(f"no libnvrtc under {libdir}")
    return ctypes.CDLL(lib[0]), os.path.join(home, "nvidia", "cu13", "include")


def report(nv, include, name, arch, defines):
    src = expand(os.path.join(KDIR, name)).encode()
    prog = ctypes.c_void_p()
    nv.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), 0, None, None)
    opts = [f"--gpu-architecture={arch}", "--std=c++17", "--ptxas-options=-v", f"-I{include}"]
    opts += [f"-D{d}" for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetProgramLog(prog, log)
    nv.nvrtcDestroyProgram(ctypes.byref(prog))
    if rc != 0:
        sys.exit(f"{name}: NVRTC failed\n{log.value.decode()}")
    rows, entry = {}, None
    for line in log.value.decode().splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            entry = m.group(1)
            rows[entry] = {}
        elif entry:
            for key, pat in (("regs", r"Used (\d+) registers"), ("stack", r"(\d+) bytes stack frame"),
                             ("spill_st", r"(\d+) bytes spill stores"), ("spill_ld", r"(\d+) bytes spill loads"),
                             ("smem", r"(\d+) bytes smem")):
                m = re.search(pat, line)
                if m:
                    rows[entry][key] = int(m.group(1))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="sources under crates/kiln-cuda/src/ops (op/file.cu)")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="a define, e.g. KILN_DIRECT_U=3")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--match", default="", help="only entry points whose name contains this")
    a = ap.parse_args()
    nv, include = nvrtc()
    print(f"{'entry point':44s} {'regs':>5s} {'stack':>6s} {'spill st/ld':>12s} {'smem':>7s}")
    for f in a.files:
        for entry, r in report(nv, include, f, a.arch, a.defines).items():
            if a.match in entry:
                spill = f"{r.get('spill_st', 0)}/{r.get('spill_ld', 0)}"
                print(f"{entry:44s} {r.get('regs', 0):5d} {r.get('stack', 0):6d} {spill:>12s} {r.get('smem', 0):7d}")


if __name__ == "__main__":
    main()
