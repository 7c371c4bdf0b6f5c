"""Each point against its reference image."""


def reference_store(wildcards):
    point = point_of(wildcards)
    return f"{RESULTS}/{wildcards.scenario}/reference/{point.reference_name}/image.zarr"


rule compare:
    input:
        store=f"{RESULTS}/{{scenario}}/points/{{point}}/image.zarr",
        reference=reference_store,
    output:
        f"{RESULTS}/{{scenario}}/points/{{point}}/comparison.json",
    log:
        f"{RESULTS}/logs/compare/{{scenario}}/{{point}}.log",
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/compare.py"
