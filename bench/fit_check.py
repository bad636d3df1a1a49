#!/usr/bin/env python3
"""`kiln fit`'s predicted peak against the peak a real run reaches, for one
model at one context and batch, on the CPU (peak RSS) or a CUDA device
(nvidia-smi's memory.used, sampled every 20 ms, minus a baseline taken
before Kiln starts).

The run is `kiln bench-engine` in exactly the configuration `fit` priced:
the KV pool pinned to fit's KV term (`--kv-mib`, not sized from free
memory), BATCH concurrent requests whose prompt and generated tokens fill
CONTEXT, so every KV block is written and prefill runs full chunks.

    bench/fit_check.py --kiln target/release/kiln --model M --device cuda \
        --context 4096 --batch 16 --out fit-4096x16.json

Writes one JSON object: predicted (fit's terms and total), measured (the
peak, and Kiln's own counters: the device pool's peak active and reserved
bytes, the process's VmHWM), ratio = predicted / measured and the error in
percent. Exits 0 when the run completed (even when the error is large: the
numbers are the result); 2 when the error is over --tolerance and
--strict is given.
"""
import argparse
import json
import math
import os
import resource
import subprocess
import sys
import threading
import time

MIB = 1 << 20


def smi(*args):
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=True).stdout


def smi_used_mib(gpu):
    return float(smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(gpu)).split()[0])


class Sampler:
    """memory.used of one GPU every `ms` milliseconds, in a background nvidia-smi."""

    def __init__(self, gpu, ms):
        self.samples = []
        self.proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
             "-i", str(gpu), "-lms", str(ms)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.samples.append((time.time(), float(line.strip())))
            except ValueError:
                pass

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.thread.join(timeout=5)
        return self.samples


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    ap.add_argument("--context", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--gen", type=int, default=4, help="generated tokens per request (the rest of the context is prompt)")
    ap.add_argument("--threads", type=int, default=None, help="kiln --threads")
    ap.add_argument("--sample-ms", type=int, default=20)
    ap.add_argument("--tolerance", type=float, default=5.0, help="percent")
    ap.add_argument("--strict", action="store_true", help="exit 2 when the error is over --tolerance")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    on_device = a.device != "cpu"
    gpu = int(a.device.split(":")[1]) if ":" in a.device else 0
    kiln = [a.kiln] + (["--threads", str(a.threads)] if a.threads else [])
    res = {"model": a.model, "device": a.device, "context": a.context, "batch": a.batch, "gen_tokens": a.gen}

    # (a) The prediction. On a device, plan against the whole GPU so the
    # CUDA context is counted (the measured peak includes it).
    fit_cmd = kiln + ["fit", a.model, "--device", a.device, "--context", str(a.context),
                      "--batch", str(a.batch), "--json"]
    if on_device:
        total_mib = float(smi("--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", str(gpu)).split()[0])
        fit_cmd += ["--memory-bytes", str(int(total_mib * MIB))]
        res["gpu"] = smi("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader", "-i", str(gpu)).strip()
    fit = json.loads(subprocess.run(fit_cmd, capture_output=True, text=True, check=True).stdout)
    res["fit"] = fit
    predicted = fit["total_bytes"]
    kv_mib = math.ceil(fit["kv_bytes"] / MIB)

    # (b) The run at the same setting.
    run_cmd = kiln + ["bench-engine", "--device", a.device, "-m", a.model,
                      "--kv-mib", str(kv_mib), "--concurrency", str(a.batch),
                      "--prompt-tokens", str(a.context - a.gen), "--gen-tokens", str(a.gen),
                      "--prefix-tokens", "16"]
    res["command"] = " ".join(run_cmd)
    sampler = None
    if on_device:
        base = [smi_used_mib(gpu) for _ in range(3)]
        res["baseline_mib"] = max(base)
        sampler = Sampler(gpu, a.sample_ms)
        time.sleep(0.2)
    t0 = time.time()
    proc = subprocess.run(run_cmd, capture_output=True, text=True)
    res["run_seconds"] = time.time() - t0
    samples = sampler.stop() if sampler else []
    child_maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    res["stderr_tail"] = proc.stderr[-3000:]
    if proc.returncode != 0:
        res["error"] = f"bench-engine exited with {proc.returncode}"
        json.dump(res, open(a.out, "w"), indent=1)
        print(res["error"], proc.stderr[-2000:], file=sys.stderr)
        return 1
    bench = json.loads(proc.stdout.strip().splitlines()[-1])
    res["bench"] = {k: bench.get(k) for k in ("kv_blocks", "kv_bytes", "num_preemptions", "device_memory", "peak_rss_bytes")}
    res["bench"]["levels"] = bench.get("levels")

    if on_device:
        peak_mib = max(v for _, v in samples)
        res["samples"] = len(samples)
        res["peak_used_mib"] = peak_mib
        measured = int((peak_mib - res["baseline_mib"]) * MIB)
        res["measured_source"] = "nvidia-smi memory.used peak - baseline"
        dm = bench.get("device_memory") or {}
        res["kiln_pool_peak_active_bytes"] = dm.get("peak_active_bytes")
        res["kiln_pool_reserved_bytes"] = dm.get("reserved_bytes")
        if dm.get("reserved_bytes") is not None:
            # Measured terms next to fit's, for calibrating the equation:
            # the pool's peak above weights and KV is the activations' live
            # peak; what it keeps cached on top; and what the pool never sees
            # (the CUDA context, cuBLAS' handle, kernel modules).
            live = dm["peak_active_bytes"] - fit["weights_bytes"] - (bench.get("kv_bytes") or fit["kv_bytes"])
            res["measured_terms_mib"] = {
                "activations_live_peak": live / MIB,
                "pool_cached_at_end": (dm["reserved_bytes"] - dm["active_bytes"]) / MIB,
                "outside_pool": (measured - dm["reserved_bytes"]) / MIB,
            }
            res["predicted_terms_mib"] = {
                "activations": fit["activation_bytes"] / MIB,
                **{k: v / MIB for k, v in fit["overheads"].items()},
            }
    else:
        rss = bench.get("peak_rss_bytes")
        measured = rss if rss else child_maxrss
        res["children_maxrss_bytes"] = child_maxrss  # the largest child so far (a cross-check)
        res["measured_source"] = "bench-engine VmHWM (peak RSS)"
    res["predicted_bytes"] = predicted
    res["measured_bytes"] = measured
    res["ratio"] = predicted / measured
    res["error_percent"] = 100.0 * (predicted - measured) / measured
    res["within_tolerance"] = abs(res["error_percent"]) <= a.tolerance
    res["predicted_mib"] = predicted / MIB
    res["measured_mib"] = measured / MIB
    json.dump(res, open(a.out, "w"), indent=1)
    print(f"fit {a.device} context {a.context} batch {a.batch}: predicted {predicted / MIB:.0f} MiB, "
          f"measured {measured / MIB:.0f} MiB ({res['measured_source']}), error {res['error_percent']:+.1f} %"
          f", preemptions {bench.get('num_preemptions')}")
    if a.strict and not res["within_tolerance"]:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
