"""A dataset as a merging experiment (a `merge:` section): per scenario and experiment, the truth's |F|, each
shot's start, a poor starting |F|, the shots and the shared flags that `nbsim merge` reads; then (merge.run)
`nbsim merge` of each experiment's first n shots for each n of merge.shots, the pipeline's last rule, and the
table of their CC and CCano* by resolution shell (docs/sweeps.md, "Merging a dataset")."""


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


rule merge:
    input:
        manifest=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/merge.json",
        shots=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/shots.txt",
        starts=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/starts.json",
        start=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/start.mtz",
        truth=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/truth.mtz",
        flags=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/flags.txt",
    output:
        mtz=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/shots_{{shots}}/merged.mtz",
        json=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/shots_{{shots}}/merged.json",
        page=f"{RESULTS}/{{scenario}}/merge/{{experiment}}/shots_{{shots}}/report.html",
        plot=report(
            f"{RESULTS}/{{scenario}}/merge/{{experiment}}/shots_{{shots}}/report.png",
            caption="../report/merge_scores.rst",
            category="{scenario}",
            subcategory="merge",
        ),
    log:
        f"{RESULTS}/logs/merge/{{scenario}}/{{experiment}}/shots_{{shots}}.log",
    message:
        "merge {wildcards.scenario}/{wildcards.experiment}: {wildcards.shots} shots"
    wildcard_constraints:
        shots=r"[0-9]+",
    params:
        shots=lambda w: int(w.shots),
        settings=MERGE,
    threads: MERGE["workers"] * MERGE["threads"] if MERGE else 1
    resources:
        mem_mb=config["resources"]["mem_mb"],
        runtime=config["resources"]["runtime_min"],
        slurm_partition=slurm_partition,
        slurm_account=SLURM["account"] or "",
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/merge.py"


rule merge_table:
    input:
        merges=merge_files,
    output:
        csv=report(
            f"{RESULTS}/{{scenario}}/tables/merge.csv",
            caption="../report/merge_table.rst",
            category="{scenario}",
            subcategory="tables",
        ),
    log:
        f"{RESULTS}/logs/merge_table/{{scenario}}.log",
    params:
        axes=[axis for axis in AXES if axis != "draw"],
    localrule: True
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/merge_table.py"
