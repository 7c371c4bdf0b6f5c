"""Tables, the collated store, plots and report entries for each scenario (local rules)."""


rule collate:
    input:
        records=lambda w: batch_files(w, "records.json"),
        references=reference_records,
        fits=fit_files,
        merges=merge_files,
    output:
        **collate_outputs(),
    log:
        f"{RESULTS}/logs/collate/{{scenario}}.log",
    params:
        axes=AXES,
        stores=batch_stores,
        min_photons=config["sweep"]["min_photons"],
    localrule: True
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/collate.py"


rule summary:
    input:
        records=all_records,
        references=all_reference_records,
    output:
        rst=f"{RESULTS}/summary.rst",
        csv=report(
            f"{RESULTS}/summary.csv",
            caption="../report/summary.rst",
            category="summary",
        ),
        html=f"{RESULTS}/summary.html",
    log:
        f"{RESULTS}/logs/summary.log",
    params:
        by_scenario=records_by_scenario(),
        axes=AXES,
    localrule: True
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/summary.py"


rule plots:
    input:
        records=lambda w: batch_files(w, "records.json"),
        references=reference_records,
    output:
        speedup=report(
            f"{RESULTS}/{{scenario}}/plots/speedup.png",
            caption="../report/speedup.rst",
            category="{scenario}",
            subcategory="plots",
        ),
        warm_time=report(
            f"{RESULTS}/{{scenario}}/plots/warm_time.png",
            caption="../report/warm_time.rst",
            category="{scenario}",
            subcategory="plots",
        ),
        previews=report(
            f"{RESULTS}/{{scenario}}/plots/previews.png",
            caption="../report/previews.rst",
            category="{scenario}",
            subcategory="plots",
        ),
    log:
        f"{RESULTS}/logs/plots/{{scenario}}.log",
    params:
        axes=AXES,
        stores=batch_stores,
    localrule: True
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/plots.py"
