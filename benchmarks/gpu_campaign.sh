#!/usr/bin/env bash
# The GPU campaign in one call (benchmarks/gpu_campaign.py says what it runs; docs/benchmarks.md how to
# prepare a lent machine): with the machine's own python3, or $PYTHON.
#   bash benchmarks/gpu_campaign.sh [--cpu] [--c-binary PATH] [--out DIR] [--budget-s S] [--only STEP ...]
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_campaign.py "$@"
