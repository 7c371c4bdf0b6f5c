"""A dataset as a merging experiment (a `merge:` section): per scenario and experiment, the truth's |F|, each
shot's start, a poor starting |F|, the shots and the shared flags that `nbsim merge` reads (docs/sweeps.md,
"Merging a dataset")."""


rule merge_inputs:
    input:
        records=lambda w: batch_files(w, "records.json"),
    output:
        truth=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/truth.mtz",
        start=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/start.mtz",
        starts=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/starts.json",
        shots=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/shots.txt",
        flags=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/flags.txt",
        manifest=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/merge.json",
        spectra=directory(f"{RESULTS}/{{scenario}}/merge/{{experiment}}/spectra"),
    log:
        f"{RESULTS}/logs/merge_inputs/{{scenario}}/{{experiment}}.log",
    message:
        "merge inputs {wildcards.scenario}/{wildcards.experiment}: {params.summary}"
    params:
        names=lambda w: list(MERGE_EXPERIMENTS[(w.scenario, w.experiment)]),
        summary=lambda w: f"{len(MERGE_EXPERIMENTS[(w.scenario, w.experiment)])} shots",
        drawn=DRAWN_KEYS,
        settings=MERGE,
    threads: 1
    resources:
        mem_mb=config["resources"]["mem_mb"],
        runtime=config["resources"]["runtime_min"],
        slurm_partition=slurm_partition,
        slurm_account=SLURM["account"] or "",
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/merge_inputs.py"
