"""nbsim sweep: fan scenarios × sizes × dtypes × devices × compile (× extra options) out to the simulator,
keep every image in zarr, and collate timing and correlation tables, a collated store, plots and a report.

    snakemake --workflow-profile workflow/profiles/default                  # config/config.yaml
    snakemake --workflow-profile workflow/profiles/default --configfile config/examples/mosaic_sweep.yaml
"""

from snakemake.utils import min_version

min_version("9.0")

# A --configfile replaces the default sweep instead of being merged into it.
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/simulate.smk"
include: "workflow/rules/collate.smk"
include: "workflow/rules/fit.smk"
include: "workflow/rules/merge.smk"


report: "workflow/report/workflow.rst"


rule all:
    input:
        all_outputs(),
    localrule: True
    default_target: True
