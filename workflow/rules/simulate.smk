"""One timed simulation per point, and one reference image per (scenario, size, extra values); before them,
one untimed job per kernel structure, dtype and device builds its ahead-of-time kernels into the shared
cache (in parallel)."""


rule kernel:
    output:
        f"{RESULTS}/kernels/{{kernel}}.json",
    log:
        f"{RESULTS}/logs/kernel/{{kernel}}.log",
    params:
        kernel=kernel_job,
    threads: 1
    priority: 10
    resources:
        mem_mb=config["resources"]["mem_mb"],
        runtime=config["resources"]["runtime_min"],
        slurm_partition=slurm_partition,
        slurm_account=SLURM["account"] or "",
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/kernel.py"


rule simulate:
    input:
        kernel=point_kernel,
    output:
        store=directory(f"{RESULTS}/{{scenario}}/points/{{point}}/image.zarr"),
        timing=f"{RESULTS}/{{scenario}}/points/{{point}}/timing.json",
    log:
        f"{RESULTS}/logs/simulate/{{scenario}}/{{point}}.log",
    params:
        job=point_job,
    threads: TIMING["threads"]
    resources:
        timing_slot=1,
        gpu=uses_gpu,
        mem_mb=config["resources"]["mem_mb"],
        runtime=config["resources"]["runtime_min"],
        slurm_partition=slurm_partition,
        slurm_account=SLURM["account"] or "",
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/simulate.py"


rule reference:
    input:
        kernel=reference_kernel,
    output:
        store=directory(f"{RESULTS}/{{scenario}}/reference/{{refpoint}}/image.zarr"),
        timing=f"{RESULTS}/{{scenario}}/reference/{{refpoint}}/timing.json",
    log:
        f"{RESULTS}/logs/reference/{{scenario}}/{{refpoint}}.log",
    params:
        job=reference_job,
    threads: TIMING["threads"]
    resources:
        timing_slot=1,
        mem_mb=config["resources"]["mem_mb"],
        runtime=config["resources"]["runtime_min"],
        slurm_partition=slurm_partition,
        slurm_account=SLURM["account"] or "",
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/reference.py"
