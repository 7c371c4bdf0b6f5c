"""Batches of timed points and their references, each batch one job (one process, one SLURM job);
before them, one untimed job per kernel structure, dtype and device makes its compiled kernels ready in
the shared cache (in parallel): ahead-of-time packages built and probed, or the just-in-time compile
warmed where that is what the points will run (nbsim.sweep.jobs.build_kernel)."""


rule kernel:
    output:
        f"{RESULTS}/kernels/{{kernel}}.json",
    log:
        f"{RESULTS}/logs/kernel/{{kernel}}.log",
    params:
        kernel=kernel_job,
    threads: KERNEL_THREADS
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


rule reference:
    input:
        kernels=reference_kernels,
    output:
        records=f"{RESULTS}/{{scenario}}/references/{{batch}}/records.json",
    log:
        f"{RESULTS}/logs/reference/{{scenario}}/{{batch}}.log",
    message:
        "reference batch {wildcards.scenario}/{wildcards.batch}: {params.summary}"
    params:
        job=reference_job,
        summary=reference_summary,
        store=lambda w: batch_store(w, "references"),
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


rule simulate:
    input:
        kernels=batch_kernels,
        reference=reference_records_of_batch,
    output:
        records=f"{RESULTS}/{{scenario}}/batches/{{batch}}/records.json",
    log:
        f"{RESULTS}/logs/simulate/{{scenario}}/{{batch}}.log",
    message:
        "batch {wildcards.scenario}/{wildcards.batch}: {params.summary}"
    params:
        job=batch_job,
        summary=batch_summary,
        store=batch_store,
    threads: TIMING["threads"]
    resources:
        timing_slot=TIMING_SLOT,
        gpu=uses_gpu,
        mem_mb=config["resources"]["mem_mb"],
        runtime=config["resources"]["runtime_min"],
        slurm_partition=slurm_partition,
        slurm_account=SLURM["account"] or "",
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/simulate.py"
