"""The sweep behind the Snakemake workflow, in the order a run uses it:

* `plan` — points, batches and kernel jobs (torch-free: the Snakefile imports it to build the DAG);
* `validate` — the configuration against its schema and what a schema cannot check;
* `jobs` — job bodies: build kernels, render and time a batch, render its references;
* `store` — JSON records and zarr stores, written atomically;
* `collate` — tables and the collated store, built point by point;
* `plots` — speedup, warm time and previews;
* `progress` — points done / total and rate, for long jobs.
"""
