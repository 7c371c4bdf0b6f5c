"""Each point against its reference image (light: a local rule, also on a cluster)."""


rule compare:
    input:
        store=f"{RESULTS}/{{scenario}}/points/{{point}}/image.zarr",
        reference=reference_store,
    output:
        f"{RESULTS}/{{scenario}}/points/{{point}}/comparison.json",
    log:
        f"{RESULTS}/logs/compare/{{scenario}}/{{point}}.log",
    localrule: True
    conda:
        "../envs/nbsim.yaml"
    script:
        "../scripts/compare.py"
