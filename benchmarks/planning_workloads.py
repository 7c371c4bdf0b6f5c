"""The CPU time of a sweep's planning, as workflow/rules/common.smk does it (validation, points, batches,
kernel jobs, every batch's and reference's specs), with one `PointBuilds` shared by all of it, with one
that keeps parses but not configurations, and with none (each call its own). No target: it measured
whether the planning's memo is needed (docs/benchmarks.md, "Planning").

    python benchmarks/planning_workloads.py dataset shared    # config/examples/<name>.yaml, a mode

Run it twice: the first run of a changed nbsim computes the kernel structures (importing PyTorch) and
keeps them in a memo under the temporary folder, as `.snakemake/nbsim-structures.json` does.
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path

import yaml

from nbsim.sweep import plan, validate

REPO = Path(__file__).resolve().parent.parent
MODES = ("shared", "parses_only", "per_call")


class ParsesOnly(plan.PointBuilds):
    """A PointBuilds that forgets each configuration once built (it keeps the parses)."""

    def configured(self, argv, options, settings=()):
        """As PointBuilds.configured, keeping no configuration."""
        self._configured.clear()
        return super().configured(argv, options, settings)


def plan_cpu_s(name: str, mode: str) -> tuple[int, float]:
    """How many points config/examples/<name>.yaml plans, and the CPU seconds it takes in `mode`."""
    config = yaml.safe_load((REPO / "config" / "examples" / f"{name}.yaml").read_text())
    base = REPO / "config" / "examples"
    builds = {"shared": plan.PointBuilds, "parses_only": ParsesOnly, "per_call": lambda: None}[mode]()
    memo = Path(tempfile.gettempdir()) / f"nbsim-planning-{name}.json"
    begin = time.process_time()
    validate.validate_config(config, REPO / "workflow" / "schemas" / "config.schema.yaml", base, builds=builds)
    points = plan.sweep_points(config)
    batches = plan.plan_sweep(points, config["sweep"]["batch_size"])
    compiled_reference = config["reference"] is not False and config["reference"].get("compile", False)
    _, kernel_of = plan.kernel_jobs(config, points, compiled_reference, base, memo, builds)
    for batch in batches.batches.values():
        [plan.point_spec(config, point, base, kernel_of, builds=builds) for point in batch.points]
    if config["reference"] is not False:
        for batch in batches.references.values():
            [plan.point_spec(config, point, base, kernel_of, as_reference=True, builds=builds)
             for point in batch.points]
    return len(points), time.process_time() - begin


if __name__ == "__main__":
    name, mode = sys.argv[1], sys.argv[2]
    if mode not in MODES:
        sys.exit(f"mode must be one of {', '.join(MODES)}")
    count, cpu_s = plan_cpu_s(name, mode)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{name} {mode}: {count} points planned in {cpu_s:.2f} s of CPU, peak RSS {peak_mb:.0f} MB")
