"""The `gradients` benchmark workload (run by benchmarks/run.py): what the gradient of an image costs.

The heavy workload (300 steps per pixel, float32, CPU) is rendered at 256² and 1024² in a new process per
size, eagerly: the render without gradients (`forward_s`), and with the distance as a tensor that requires
grad the render (`grad_s`) and `image.sum().backward()` (`backward_s`), each the median of REPEATS calls
after a warm-up at 32² (eager: nothing to build; set-up, `resolve`, timed apart), and the process's peak
RSS, under MALLOC. Target: the backward at
most 3× the forward without gradients. The compiled path is recorded as not offered, with nbsim's reason
(`nbsim.kernel.policy.GRADIENT_NOTE`; the one-off measurements behind it are in docs/kernels.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from nbsim import workloads

SIZES, QUICK_SIZES = (256, 1024), (64, 128)
REPEATS = 1
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc's fixed mmap threshold, as docs/kernels.md advises for gradients: without it the dynamic threshold
lets the heap grow with the number of tiles (the memory the checkpointed tiles free is not returned)."""
MAX_BACKWARD_RATIO = 3.0

TIMED = """
import json, resource, statistics, sys, time
import torch, nbsim
from nbsim.render import Renderer
from nbsim.setup import resolve
args, size, repeats = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

def once(config, grad):
    distance = torch.tensor(200.0, requires_grad=grad)
    begin = time.perf_counter()
    renderer = Renderer(resolve(config.with_options(distance_mm=distance)), compile="off")
    rendering = time.perf_counter()
    image = renderer()
    rendered = time.perf_counter()
    if grad:
        image.sum().backward()
    return rendering - begin, rendered - rendering, time.perf_counter() - rendered

small = nbsim.config_from_args([*args, "-detpixels", "32"])
once(small, False), once(small, True)
config = nbsim.config_from_args([*args, "-detpixels", str(size)])
result = {}
for key, grad in (("forward", False), ("grad", True)):
    setup_s, forward_s, backward_s = (statistics.median(v) for v in zip(*(once(config, grad) for _ in range(repeats))))
    result[key + "_s"] = forward_s
    if grad:
        result.update(setup_grad_s=setup_s, backward_s=backward_s)
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
        completed = subprocess.run([sys.executable, "-c", TIMED, json.dumps(base), str(size), str(REPEATS)],
                                   capture_output=True, text=True, cwd=folder, env={**os.environ, **MALLOC})
        if completed.returncode != 0:
            return {"error": f"{size}²: " + (completed.stderr.strip().splitlines() or ["no output"])[-1]}
        eager = json.loads(completed.stdout.strip().splitlines()[-1])
        eager["forward_backward_s"] = eager["grad_s"] + eager["backward_s"]
        eager["backward_ratio"] = eager["backward_s"] / eager["forward_s"]
        sizes[str(size)] = {"eager": eager, "compiled": {"not_offered": GRADIENT_NOTE}}
    return {"command": ["python", "-c", "<simulate heavy, distance requires grad; image.sum().backward()>"],
            "result": {"workload": "heavy (300 steps per pixel), float32, cpu", "repeats": REPEATS, "env": MALLOC,
                       "sizes": sizes}}


def gradients_verdict(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"]
    ratios = [size["eager"]["backward_ratio"] for size in record["result"]["sizes"].values()]
    return "met" if max(ratios) <= MAX_BACKWARD_RATIO else f"missed (backward up to {max(ratios):.1f}× forward)"


def gradients_row(name: str, record: dict) -> str:
    if "error" in record:
        return f"| {name} | failed: {record['error']} |"
    parts = []
    for size, paths in record["result"]["sizes"].items():
        eager = paths["eager"]
        parts.append(f"{size}²: forward {eager['forward_s']:.2f} s, with gradients {eager['grad_s']:.2f} s + backward "
                     f"{eager['backward_s']:.2f} s "
                     f"(backward {eager['backward_ratio']:.1f}× forward), peak RSS {eager['peak_rss_mb']:.0f} MB")
    return f"| {name} | eager: " + "; ".join(parts) + "; compiled: not offered |"


GRADIENT_WORKLOADS = {"gradients": (run_gradients, gradients_verdict, gradients_row,
                                    f"backward <= {MAX_BACKWARD_RATIO:g}x forward")}
