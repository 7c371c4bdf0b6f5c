"""Tables, the collated store, plots and report entries for each scenario (local rules)."""


def collate_outputs():
    """Timing tables and the collated store; correlation tables with a reference, labels with draws."""
    outputs = dict(
        timing_csv=report(
            f"{RESULTS}/{{scenario}}/tables/timing.csv",
            caption="../report/timing.rst",
            category="{scenario}",
            subcategory="tables",
        ),
        timing_md=f"{RESULTS}/{{scenario}}/tables/timing.md",
        store=directory(f"{RESULTS}/{{scenario}}/sweep.zarr"),
    )
    if REFERENCE:
        outputs.update(
            correlation_csv=report(
                f"{RESULTS}/{{scenario}}/tables/correlation.csv",
                caption="../report/correlation.rst",
                category="{scenario}",
                subcategory="tables",
            ),
            correlation_md=f"{RESULTS}/{{scenario}}/tables/correlation.md",
        )
    if "draws" in config["sweep"]:
        outputs.update(labels_csv=f"{RESULTS}/{{scenario}}/tables/labels.csv")
    return outputs


def batch_stores(wildcards):
    return [str(Path(p).with_name("images.zarr")) for p in batch_files(wildcards, "records.json")]


rule collate:
    input:
        records=lambda w: batch_files(w, "records.json"),
        references=reference_records,
    output:
        **collate_outputs(),
    log:
        f"{RESULTS}/logs/collate/{{scenario}}.log",
    params:
        axes=AXES,
        stores=batch_stores,
    localrule: True
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/collate.py"


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
