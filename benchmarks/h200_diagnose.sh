#!/usr/bin/env bash
# Small-shape conformance one op per process with synchronous launches, so a device fault names its op and case.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_LAUNCH_BLOCKING=1
for op in mla_decode attention_varlen write_kv_cache quantize_fp8 gemm grouped_gemm moe_route ep_dispatch ep_combine \
          rms_norm rope silu_and_mul sample; do
  timeout 60 deepinfer conformance --backend cuda_sm100 --ops "$op" --seed 7 --report "$OUT/small_$op.json" 2>&1 \
    | grep -E "PASSED|FAILED|error|Error" | head -4
done
