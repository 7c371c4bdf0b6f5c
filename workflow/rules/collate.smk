"""Tables, the collated store, plots and report entries for each scenario (local rules)."""


rule collate:
    input:
        timings=lambda w: point_files(w.scenario, "timing.json"),
        comparisons=lambda w: point_files(w.scenario, "comparison.json"),
        stores=lambda w: point_files(w.scenario, "image.zarr"),
        references=lambda w: sorted(set(reference_timings(w).values())),
    output:
        timing_csv=report(
            f"{RESULTS}/{{scenario}}/tables/timing.csv",
            caption="../report/timing.rst",
            category="{scenario}",
            subcategory="tables",
        ),
        timing_md=f"{RESULTS}/{{scenario}}/tables/timing.md",
        correlation_csv=report(
            f"{RESULTS}/{{scenario}}/tables/correlation.csv",
            caption="../report/correlation.rst",
            category="{scenario}",
            subcategory="tables",
        ),
        correlation_md=f"{RESULTS}/{{scenario}}/tables/correlation.md",
        store=directory(f"{RESULTS}/{{scenario}}/sweep.zarr"),
    log:
        f"{RESULTS}/logs/collate/{{scenario}}.log",
    params:
        axes=AXES,
        references=reference_timings,
    localrule: True
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/collate.py"


rule plots:
    input:
        timings=lambda w: point_files(w.scenario, "timing.json"),
        comparisons=lambda w: point_files(w.scenario, "comparison.json"),
        stores=lambda w: point_files(w.scenario, "image.zarr"),
        references=lambda w: sorted(set(reference_timings(w).values())),
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
        references=reference_timings,
    localrule: True
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/plots.py"
