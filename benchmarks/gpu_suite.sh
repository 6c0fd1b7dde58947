#!/usr/bin/env bash
# The GPU measurements as one command (benchmarks/gpu_suite.py says what it runs):
#   bash benchmarks/gpu_suite.sh            # on one H100/H200, under 8 minutes; then commit the folder
#   bash benchmarks/gpu_suite.sh --tiny     # the same steps on CPU at tiny sizes
# Needs only PyTorch, transformers, numpy and scipy: the package runs from src/, nothing installed.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src:benchmarks${PYTHONPATH:+:$PYTHONPATH}"
exec python3 benchmarks/gpu_suite.py "$@"
