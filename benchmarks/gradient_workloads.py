"""The `gradients` benchmark workload (run by benchmarks/run.py): what the gradient of an image costs.

The heavy workload (300 steps per pixel, float32, CPU) is rendered at 256² and 1024² in a new process per
size and phase, eagerly: the render without gradients (`forward_s`), then, in another process, with the
distance as a tensor that requires grad, the render (`grad_s`) and `image.sum().backward()`
(`backward_s`); one call each after a warm-up at 32² (eager: nothing to build; set-up, `resolve`, timed
apart), and the processes' peak RSS, under MALLOC, each process stopping itself above MAX_RSS_MB.
Target: the backward at most 3× the forward without gradients. The compiled path is recorded as not
offered, with nbsim's reason (`nbsim.kernel.policy.GRADIENT_NOTE`; the one-off measurements behind it
are in docs/kernels.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import workloads

SIZES, QUICK_SIZES = (256, 1024), (64, 128)
MAX_RSS_MB = 6000
"""A process above this much resident memory stops itself (and the workload reports it) before it can
take the machine's memory."""
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc's fixed mmap threshold, as docs/kernels.md advises for gradients: without it the dynamic threshold
lets the heap grow with the number of tiles (the memory the checkpointed tiles free is not returned)."""
MAX_BACKWARD_RATIO = 3.0

TIMED = """
import json, os, resource, sys, threading, time
import torch, nbsim
from nbsim.render import Renderer
from nbsim.resolve import resolve
args, size, grad, limit_mb = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "grad", int(sys.argv[4])

def watch():
    while True:
        resident_mb = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        if resident_mb > limit_mb:
            print(json.dumps({"error": f"resident memory above {limit_mb} MB: stopped"}), flush=True)
            os._exit(3)
        time.sleep(0.2)

threading.Thread(target=watch, daemon=True).start()

def once(config):
    distance = torch.tensor(200.0, requires_grad=grad)
    begin = time.perf_counter()
    renderer = Renderer(resolve(config.with_options(distance_mm=distance)), compile="off")
    rendering = time.perf_counter()
    image = renderer()
    rendered = time.perf_counter()
    if grad:
        image.sum().backward()
    done = time.perf_counter()
    return {"setup_s": rendering - begin, "render_s": rendered - rendering, "backward_s": done - rendered}

once(nbsim.config_from_args([*args, "-detpixels", "32"]))
result = once(nbsim.config_from_args([*args, "-detpixels", str(size)]))
result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(result))
"""


def run_gradients(quick: bool, folder: Path) -> dict:
    from nbsim.kernel.policy import GRADIENT_NOTE

    golden = Path(__file__).resolve().parent.parent.parent / "shared" / "golden"
    base = [a.replace("{golden}", str(golden)) for a in workloads.HEAVY_ARGS]
    if not (golden / "synthetic_P1.hkl").is_file():
        return {"error": f"needs {golden / 'synthetic_P1.hkl'}"}
    sizes = {}
    for size in QUICK_SIZES if quick else SIZES:
        phases = {}
        for phase in ("forward", "grad"):
            completed = subprocess.run([sys.executable, "-c", TIMED, json.dumps(base), str(size), phase,
                                        str(MAX_RSS_MB)], capture_output=True, text=True, cwd=folder,
                                       env={**os.environ, **MALLOC})
            lines = completed.stdout.strip().splitlines()
            phases[phase] = json.loads(lines[-1]) if lines else {"error": (completed.stderr.strip().splitlines()
                                                                           or ["no output"])[-1]}
        failed = [f"{phase}: {phases[phase]['error']}" for phase in phases if "error" in phases[phase]]
        if failed:
            sizes[str(size)] = {"error": "; ".join(failed)}
            continue
        forward, grad = phases["forward"], phases["grad"]
        eager = {"forward_s": forward["render_s"], "grad_s": grad["render_s"], "backward_s": grad["backward_s"],
                 "setup_grad_s": grad["setup_s"], "peak_rss_mb": max(forward["peak_rss_mb"], grad["peak_rss_mb"])}
        eager["forward_backward_s"] = eager["grad_s"] + eager["backward_s"]
        eager["backward_ratio"] = eager["backward_s"] / eager["forward_s"]
        sizes[str(size)] = {"eager": eager, "compiled": {"not_offered": GRADIENT_NOTE}}
    return {"command": ["python", "-c", "<simulate heavy, distance requires grad; image.sum().backward()>"],
            "result": {"workload": "heavy (300 steps per pixel), float32, cpu", "env": MALLOC,
                       "sizes": sizes}}


def gradients_verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    sizes = record["result"]["sizes"]
    failed = [f"{size}² {paths['error']}" for size, paths in sizes.items() if "error" in paths]
    if failed:
        return "failed: " + "; ".join(failed)
    ratios = [paths["eager"]["backward_ratio"] for paths in sizes.values()]
    return "met" if max(ratios) <= MAX_BACKWARD_RATIO else f"missed (backward up to {max(ratios):.1f}× forward)"


def gradients_row(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    parts = []
    for size, paths in record["result"]["sizes"].items():
        if "error" in paths:
            parts.append(f"{size}²: failed ({paths['error']})")
            continue
        eager = paths["eager"]
        parts.append(f"{size}²: forward {eager['forward_s']:.2f} s, with gradients {eager['grad_s']:.2f} s + backward "
                     f"{eager['backward_s']:.2f} s "
                     f"(backward {eager['backward_ratio']:.1f}× forward), peak RSS {eager['peak_rss_mb']:.0f} MB")
    return f"| {name} | eager: " + "; ".join(parts) + "; compiled: not offered |"


GRADIENT_WORKLOADS = {"gradients": (run_gradients, gradients_verdict, gradients_row,
                                    f"backward <= {MAX_BACKWARD_RATIO:g}x forward")}
