#!/usr/bin/env bash
# One H200 session: install, conformance (small, then full DeepSeek-V3 shapes), recompile check, benchmarks.
# Usage on the GPU machine: OUT=<dir> bash benchmarks/h200_run.sh [conformance|bench|all]
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
what=${1:-all}
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -3
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
deepinfer info --ops 2>&1 | tail -22
if [[ $what == conformance || $what == all ]]; then
  timeout 200 deepinfer conformance --backend cuda_sm100 --report "$OUT/conformance_small.json" 2>&1 | tail -25
  timeout 360 deepinfer conformance --backend cuda_sm100 --shapes full --report "$OUT/conformance_full.json" \
    --note "H200, full DeepSeek-V3 shapes" 2>&1 | tail -40
  timeout 120 python3 benchmarks/check_recompiles.py
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_imports.py 2>&1 | tail -2
fi
if [[ $what == bench || $what == all ]]; then
  timeout 500 deepinfer bench --backend cuda_sm100 --json "$OUT/bench.json" --results "$OUT/RESULTS_section.md" 2>&1 | tail -80
fi
