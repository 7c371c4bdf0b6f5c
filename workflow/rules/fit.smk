"""Fitting every shot (a `fit:` section): chunks of each batch's shots, one job each, then the table and
plot of refined − true per parameter and shot (docs/sweeps.md, "Fitting every shot")."""


rule fit:
    input:
        records=f"{RESULTS}/{{scenario}}/batches/{{batch}}/records.json",
    output:
        fits=f"{RESULTS}/{{scenario}}/fits/{{batch}}/{{chunk}}.json",
    log:
        f"{RESULTS}/logs/fit/{{scenario}}/{{batch}}/{{chunk}}.log",
    message:
        "fit {wildcards.scenario}/{wildcards.batch}/{wildcards.chunk}: {params.summary}"
    params:
        job=fit_job,
        summary=fit_summary,
        store=batch_store,
    threads: FIT["threads"] if FIT else 1
    resources:
        mem_mb=config["resources"]["mem_mb"],
        runtime=config["resources"]["runtime_min"],
        slurm_partition=slurm_partition,
        slurm_account=SLURM["account"] or "",
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/fit.py"


rule fit_table:
    input:
        fits=fit_files,
    output:
        csv=report(
            f"{RESULTS}/{{scenario}}/tables/fit.csv",
            caption="../report/fit_table.rst",
            category="{scenario}",
            subcategory="tables",
        ),
        plot=report(
            f"{RESULTS}/{{scenario}}/plots/fit_errors.png",
            caption="../report/fit_errors.rst",
            category="{scenario}",
            subcategory="plots",
        ),
    log:
        f"{RESULTS}/logs/fit_table/{{scenario}}.log",
    params:
        axes=AXES,
    localrule: True
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/fit_table.py"
