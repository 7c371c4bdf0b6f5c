# Two commands on a fresh machine:
#   make sweep   # builds .venv, runs the default sweep (config/config.yaml) and writes results/report.html
#   make test    # builds .venv, runs the whole test suite (what CI runs)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of PyTorch, the only version CI tests; nbsim needs torch>=2.8 (docs/requirements.md).
TORCH_SPEC ?= torch==2.13.0
CORES ?= 2
STAMP := $(VENV)/.installed

.PHONY: venv sweep report test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[pipeline,test]"
	touch $(STAMP)

venv: $(STAMP)

sweep: $(STAMP)
	$(BIN)/snakemake --workflow-profile workflow/profiles/default --cores $(CORES)
	$(BIN)/snakemake --report results/report.html

report: $(STAMP)
	$(BIN)/snakemake --report results/report.html

test: $(STAMP)
	$(BIN)/python -m pytest -n $(CORES) --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check nbsim tests workflow/scripts benchmarks
	$(BIN)/snakemake --lint

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf results .snakemake
