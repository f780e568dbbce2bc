#!/usr/bin/env bash
# The usual GPU runs, in steps that each fit one 10-minute device call.
# Usage on the GPU machine: OUT=<dir> bash benchmarks/h200_run.sh STEP
#   conformance  full DeepSeek-V3 shapes, then the small shapes (reports under $OUT)
#   model        model tests against transformers on cuda_sm100, then the decode benchmark with a kernel profile
#   dsa-check    DeepSeek-V3.2: the sparse-attention ops' conformance, small and full shapes (reports under $OUT),
#                then the V3.2 model tests and the CUDA-graph tests on cuda_sm100
#   dsa-bench    their `deepinfer bench` rows, then the V3.2 decode step at 64k context with a kernel profile (the
#                indexer's share)
#   prefill [ARGS]  benchmarks/bench_prefill.py ARGS: 8k-token chunks at start 0 and 24k, a 4k chunk beside 64
#                decodes, time to first token of a 32k prompt, against the compute roofline, with a kernel profile
#                ($OUT/prefill.json)
#   train-embedded [ARGS]  trains the embedded model (training/train_embedded.py ARGS):
#                $OUT/bf16, $OUT/fp8 and $OUT/training.json, to copy into model/checkpoints/tiny-py
#   embedded-check  the embedded model on cuda_sm100: held-out bits per byte and per-token log-probabilities
#                against the reference backend ($OUT/embedded_eval_cuda_sm100.json), then its tests on cuda_sm100
#   speculative  speculative decoding's tests on cuda_sm100 (CUDA graphs, batch-invariant mode), then
#                benchmarks/bench_speculative.py at batch 1, 16 and 64 ($OUT/speculative.json)
#   speculative-deep [LAYERS [MINUTES [DISTILL]]]  trains the embedded model LAYERS deep (default 24; MINUTES of
#                training, default 3.5, then DISTILL of MTP distillation, default 0) into $OUT/deep, then
#                bench_speculative.py on it at batch 1, 16 and 64
#                ($OUT/speculative_deep.json): a model whose MTP layer is a small share of its step, as DeepSeek's is
#   speculative-deep-train [LAYERS [MINUTES [DISTILL]]]  the same training (default 24 layers, 4.2 minutes), then
#                DISTILL minutes (default 2.3; with the evaluations near one call's limit) of the MTP layer alone
#                trained to the model's own next-next token (train_embedded.py --distill-minutes), into $DEEP_DIR
#                (default /tmp/deepinfer-deep), which outlives the call while the machine stays warm;
#   speculative-deep-bench  then, in the next call on that machine, bench_speculative.py on it with --step-times and
#                --profile, batch 1 over the first 8 prompts, each alone (--alone 8)
#   speculative-deep-distill [DISTILL]  after `speculative-deep-train LAYERS MINUTES 0` (a joint training near a whole
#                call, no distillation), in the next call on that machine: DISTILL minutes (default 3) of MTP
#                distillation of that model (train_embedded.py --distill-from) into $DEEP_DIR/distilled, then
#                bench_speculative.py at batch 1 over 8 prompts alone (k=3 and k=1 ahead, --step-times) and at batches
#                16 and 64 ($OUT/speculative_deep_alone.json, $OUT/speculative_deep_batches.json)
#   speculative-cut  bench_speculative.py on a DeepSeek-V3-shaped FP8 cut (2 layers and an MTP layer: a step bound by its
#                weights) with drafts from plain decoding spoiled at 20%, batch 1, 16 and 64 ($OUT/speculative_cut.json)
#   structured   benchmarks/bench_structured_output.py at batch 64: compile, mask fill and apply against a step
#                ($OUT/structured_output.json)
#   prefix-cache [ARGS]  time to first token with a prefix-cache hit against a miss (4096 + 64 tokens), the same
#                from the host tier, and one 4096-token prefix shared by 64 requests, caching on and off
#                (benchmarks/prefix_cache.py ARGS; $OUT/prefix_cache.json)
#   serving-check  on cuda_sm100: the prefix-cache and host-tier tests (copies on their own stream), the EPLB tests of
#                dispatch tables rewritten under captured CUDA graphs, and the structured-output tests
#   fp4-check    grouped_gemm's conformance at small and full shapes (the FP4 expert kernel among them, reports under
#                $OUT), then the DeepSeek-V4 FP4-expert cross-check on cuda_sm100
#   v4-graphs    DeepSeek-V4's decode graphs against eager decoding, bitwise in batch-invariant mode
#   v4-bench     the decode step of a DeepSeek-V4-Flash-shaped cut (4 layers, FP4 experts) at 4k context, batches 1, 64
#                and 256, against its bytes roofline, with a kernel profile ($OUT/model_v4.json)
#   bench [OPS]  `deepinfer bench`, all ops or the comma-separated OPS (the full run takes longer than one call: split
#                it, e.g. `bench gemm`, then `bench grouped_gemm,moe_layer`, then the rest); its JSON is rewritten after
#                every case, so a stopped run keeps its numbers
#   tiles        the mla_decode / attention_varlen tile sweep, device time from CUDA graphs
#   scores-first [ARGS]  batch-invariant mla_decode (both caches) with its scores computed first, beside the split
#                kernel alone and the default mode, at a few rows, bits checked (benchmarks/mla_scores_first.py ARGS)
#   gemm-tiles [S]  the FP8 gemm launch-shape sweep beside cuBLAS, stopped after S seconds (default 300)
#   gluon-ws [sweep [M,...]]  the warp-specialized, persistent Gluon FP8 GEMM beside cuBLAS, bits checked: M = 4096
#                on every projection, or over row counts where `gemm` takes it
#   ab OP [REV]  same-run A/B of OP's kernel module (mla_decode, grouped_gemm, gemm_invariant or sparse_mla) at git
#                REV (default HEAD) against the working tree; the device copy's .git can lag this machine's commits,
#                so REV must be a commit it has
#   ab-set OP SETTINGS...  same-run A/B of the working tree against itself with backend constants changed, one side
#                per SETTINGS (MODULE.NAME=VALUE[,...], e.g. attention.MLA_GLUON=False; OP sparse_mla_gluon: the Gluon
#                sparse kernel)
#   ep           two GPUs (nvidia-h200-x2): dispatch + combine over NCCL, then the model with its experts on both
#   ep-check     one GPU: the multi-rank dispatch kernels checked by two ranks through Gloo with CUDA tensors
#   gemm-invariant [--block-parts-max-m M]  what batch-invariant mode costs FP8 gemm at M = 1 ... 4096 (also with no
#                split over K at all), and that its rows keep their bits
#   profile-gemm the warp-specialized Gluon GEMM and cuBLAS at M=4096 under Nsight Compute (pipes, memory, stalls)
#   throughput CASE:KERNEL ...  Nsight Compute's unit throughputs (tensor pipe, shared memory banks, L2, DRAM, clock)
#                of one launch of each KERNEL (a name regex) in `benchmarks/profile_launch.py CASE`: $OUT/CASE.csv
#   profile CASE KERNEL  Nsight Compute's per-instruction stall samples of one launch of KERNEL (a name regex) in
#                `benchmarks/profile_launch.py CASE`: $OUT/CASE.csv (the SASS page, summed by stall_ledger.py), the report
# The model tests need transformers >= 5.24; the GPU image's is older: carry the wheel in .whl (see the device
# notes) and this script installs it first.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -3
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

# train_deep DIR LAYERS MINUTES TIMEOUT [DISTILL]: the embedded model LAYERS deep into DIR, then DISTILL minutes
# (default 0) of MTP distillation; fails where no model was written
train_deep() {
  timeout "$4" python3 training/train_embedded.py --out "$1" --layers "$2" --minutes "$3" \
    --distill-minutes "${5:-0}" 2>&1 \
    | grep -v "Writing model\|^{\"step\"" | tail -25
  [ -f "$1/bf16/model.safetensors" ] || { echo "no model trained in $1"; exit 1; }
}
# bench_deep DIR TIMEOUT [FLAG...]: bench_speculative.py on DIR's bf16 model at batch 1, 16 and 64
bench_deep() {
  local dir=$1 limit=$2
  shift 2
  timeout "$limit" python3 benchmarks/bench_speculative.py --model "$dir/bf16" --backend cuda_sm100 --batches 1,16,64 \
    --specs 3:ahead,1:ahead,3/32:ahead --repeats 2 --json "$OUT/speculative_deep.json" "$@" 2>&1 | tail -40
}

case ${1:-} in
  conformance)
    timeout 300 deepinfer conformance --backend cuda_sm100 --shapes full --report "$OUT/conformance_full.json" \
      --note "NVIDIA H200, full DeepSeek-V3 shapes" 2>&1 | tail -3
    timeout 200 deepinfer conformance --backend cuda_sm100 --report "$OUT/conformance_small.json" 2>&1 | tail -3 ;;
  prefix-cache)
    shift
    timeout 540 python3 benchmarks/prefix_cache.py "$OUT/prefix_cache.json" --backend cuda_sm100 --layers 2 "$@" 2>&1 \
      | grep -v "wrote model" | tail -30 ;;
  speculative)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_speculative.py --deepinfer-backend cuda_sm100 \
      --tb=short 2>&1 | tail -15
    timeout 330 python3 benchmarks/bench_speculative.py --backend cuda_sm100 --batches 1,16,64 --repeats 2 \
      --json "$OUT/speculative.json" 2>&1 | tail -30 ;;
  speculative-deep)
    train_deep "$OUT/deep" "${2:-24}" "${3:-3.5}" 330 "${4:-0}"
    bench_deep "$OUT/deep" 240
    rm -f "$OUT"/deep/*/model.safetensors ;;  # larger than what a device call brings back
  speculative-deep-train)
    rm -rf "${DEEP_DIR:=/tmp/deepinfer-deep}"
    train_deep "$DEEP_DIR" "${2:-24}" "${3:-4.2}" 570 "${4:-2.3}"
    cp "$DEEP_DIR/training.json" "$OUT/" ;;
  speculative-deep-distill)
    [ -f "${DEEP_DIR:=/tmp/deepinfer-deep}/bf16/model.safetensors" ] || { echo "no trained model in $DEEP_DIR"; exit 1; }
    timeout 330 python3 training/train_embedded.py --out "$DEEP_DIR/distilled" --distill-from "$DEEP_DIR" \
      --distill-minutes "${2:-3}" 2>&1 | grep -v "Writing model\|^{\"step\"" | tail -8
    cp "$DEEP_DIR/distilled/training.json" "$OUT/"
    timeout 100 python3 benchmarks/bench_speculative.py --model "$DEEP_DIR/distilled/bf16" --backend cuda_sm100 \
      --batches 1 --alone 8 --specs 3:ahead,1:ahead --repeats 3 --step-times --json "$OUT/speculative_deep_alone.json" \
      2>&1 | tail -12
    timeout 100 python3 benchmarks/bench_speculative.py --model "$DEEP_DIR/distilled/bf16" --backend cuda_sm100 \
      --batches 16,64 --specs 3:ahead,3/32:ahead --repeats 2 --json "$OUT/speculative_deep_batches.json" 2>&1 \
      | tail -12 ;;
  speculative-deep-bench)
    [ -f "${DEEP_DIR:=/tmp/deepinfer-deep}/bf16/model.safetensors" ] || { echo "no trained model in $DEEP_DIR"; exit 1; }
    bench_deep "$DEEP_DIR" 540 --alone 8 --step-times --profile ;;
  serving-check)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_prefix_caching.py --deepinfer-backend cuda_sm100 \
      --tb=short 2>&1 | tail -8
    timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_eplb.py -k "graph or slot" --deepinfer-backend \
      cuda_sm100 --deepinfer-device cuda --tb=short 2>&1 | tail -6
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_structured_output.py --deepinfer-backend \
      cuda_sm100 --deepinfer-device cuda --tb=short 2>&1 | tail -10 ;;
  fp4-check)
    timeout 120 deepinfer conformance --backend cuda_sm100 --ops grouped_gemm \
      --report "$OUT/conformance_grouped_gemm_small.json" 2>&1 | tail -3
    timeout 240 deepinfer conformance --backend cuda_sm100 --ops grouped_gemm --shapes full \
      --report "$OUT/conformance_grouped_gemm_full.json" 2>&1 | tail -3
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_model_v4.py -k fp4 --deepinfer-backend cuda_sm100 \
      --tb=short 2>&1 | tail -8 ;;
  speculative-cut)
    timeout 560 python3 benchmarks/bench_speculative.py --backend cuda_sm100 --cut 2 --oracle-drafts 0.2 \
      --batches 1,16,64 --specs 1,3 --max-tokens 64 --repeats 2 --json "$OUT/speculative_cut.json" 2>&1 \
      | grep -v "wrote model" | tail -20 ;;
  v4-graphs)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_model_cuda.py -k v4 --deepinfer-backend cuda_sm100 \
      --tb=short 2>&1 | tail -20 ;;
  v4-bench)
    timeout 540 python3 benchmarks/bench_model.py "$OUT/model_v4.json" --model v4 --layers 4 --context 4096 \
      --batches 1,64,256 --steps 10 --warmup 2 --profile 2>&1 | grep -v Loading | tail -60 ;;
  structured)
    timeout 300 python3 benchmarks/bench_structured_output.py --backend cuda_sm100 --batch 64 \
      --json "$OUT/structured_output.json" 2>&1 | tail -5 ;;
  model)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_model_vs_transformers.py tests/test_model_cuda.py \
      --deepinfer-backend cuda_sm100 --tb=line 2>&1 | tail -8
    timeout 300 python3 benchmarks/bench_model.py "$OUT/model_decode.json" --backend cuda_sm100 --batches 1,8,64,256 \
      --steps 20 --hf-batches 1,64 --hf-steps 3 --profile 2>&1 | grep -v Loading | tail -80 ;;
  dsa-check)
    ops=write_index_cache,indexer_topk,sparse_mla,layer_norm
    timeout 90 deepinfer conformance --backend cuda_sm100 --ops $ops --report "$OUT/conformance_dsa_small.json" 2>&1 | tail -3
    timeout 240 deepinfer conformance --backend cuda_sm100 --shapes full --ops $ops \
      --report "$OUT/conformance_dsa_full.json" 2>&1 | tail -3
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_model_v32.py tests/test_model_cuda.py \
      --deepinfer-backend cuda_sm100 --tb=short 2>&1 | tail -30 ;;
  dsa-bench)
    timeout 300 deepinfer bench --backend cuda_sm100 --ops indexer_topk,sparse_mla --json "$OUT/bench_dsa.json" 2>&1 | tail -40
    timeout 240 python3 benchmarks/bench_model.py "$OUT/model_v32.json" --model v32 --kv-format fp8_ds_mla \
      --context 65536 --batches 1,16,64 --steps 10 --profile 2>&1 | grep -v Loading | tail -60 ;;
  prefill)
    timeout 540 python3 benchmarks/bench_prefill.py "$OUT/prefill.json" --backend cuda_sm100 --profile "${@:2}" 2>&1 \
      | grep -v "wrote model" | tail -80 ;;
  train-embedded)
    python3 training/train_embedded.py --out "$OUT" "${@:2}" 2>&1 | grep -v "Writing model" ;;
  embedded-check)
    timeout 200 python3 training/evaluate_embedded.py --backend cuda_sm100 --compare reference \
      --json "$OUT/embedded_eval_cuda_sm100.json" 2>&1 | tail -25
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_embedded_model.py tests/test_model_mtp.py \
      --deepinfer-backend cuda_sm100 --tb=short 2>&1 | grep -v UNEXPECTED | tail -25 ;;
  bench)
    timeout 560 deepinfer bench --backend cuda_sm100 ${2:+--ops "$2"} --json "$OUT/bench.json" > /dev/null 2>&1
    echo "bench exit $?" ;;
  tiles)
    timeout 560 python3 benchmarks/tile_variants.py 4200 all 2>&1 | tee "$OUT/tiles.txt" | tail -60 ;;
  scores-first)
    timeout 540 python3 benchmarks/mla_scores_first.py "${@:2}" 2>&1 | tee "$OUT/scores_first.txt" | tail -40 ;;
  gemm-tiles)
    timeout "${2:-300}" python3 benchmarks/gemm_tiles.py "$OUT/gemm_tiles.json" all 2>&1 | tail -50 ;;
  gluon-ws)
    shift
    timeout 500 python3 benchmarks/gluon_gemm_ws.py "$OUT/gluon_gemm_ws.json" "$@" 2>&1 | tee "$OUT/gluon_ws.txt" | tail -60 ;;
  ab)
    timeout 560 python3 benchmarks/ab_against_git.py "$2" --rev "${3:-HEAD}" 2>&1 | tee "$OUT/ab.txt" | tail -40 ;;
  ab-set)
    op=$2; shift 2
    timeout 560 python3 benchmarks/ab_against_git.py "$op" $(printf -- '--set %s ' "$@") 2>&1 | tee "$OUT/ab.txt" \
      | tail -60 ;;
  ep)
    timeout 220 torchrun --nproc-per-node 2 benchmarks/bench_ep.py --out "$OUT/ep.json" --timeout 120 --profile 2>&1 \
      | grep -v "^W1" | tail -12
    timeout 330 torchrun --nproc-per-node 2 benchmarks/ep_model.py "$OUT/ep_model.json" --backend cuda_sm100 2>&1 \
      | grep -v "^W1" | tail -4 ;;
  ep-check)
    timeout 300 torchrun --nproc-per-node 2 benchmarks/bench_ep.py --backend gloo-cuda --check-only \
      --out "$OUT/ep_check.json" --timeout 200 2>&1 | grep -v "^W1" | tail -4 ;;
  gemm-invariant)
    shift
    timeout 420 python3 benchmarks/gemm_invariant_cost.py "$OUT/gemm_invariant.json" "$@" 2>&1 | tail -80 ;;
  profile)
    cd benchmarks && timeout 200 ncu --clock-control none -k "regex:$3" --launch-skip 3 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight -f -o "$OUT/$2" \
      python3 profile_launch.py "$2" 2>&1 | grep -v "^==PROF==" | tail -5
    ncu --import "$OUT/$2.ncu-rep" --page source --csv --print-source sass > "$OUT/$2.csv" \
      || ncu --import "$OUT/$2.ncu-rep" --page source --csv > "$OUT/$2.csv"
    ncu --import "$OUT/$2.ncu-rep" --page details --csv > "$OUT/$2_details.csv"
    python3 stall_ledger.py "$OUT/$2.csv" 2>&1 | head -40 ;;
  throughput)
    shift
    wanted="gpu__time_duration sm__cycles_elapsed sm__inst_executed_pipe_tensor_op_gmma
      l1tex__data_bank_reads l1tex__data_bank_writes l1tex__data_pipe_lsu_wavefronts_mem_shared l1tex__throughput
      lts__throughput dram__throughput dram__bytes_read dram__bytes_write sm__throughput"
    known=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
    [ -n "$known" ] || known=$(printf "%s\n" $wanted)  # no list: try them all
    metrics=""
    for m in $wanted; do
      grep -qx "$m" <<< "$known" || { echo "no metric $m"; continue; }
      case $m in
        gpu__time_duration|dram__bytes_read|dram__bytes_write|sm__inst_executed_pipe_tensor_op_gmma) metrics+="$m.sum," ;;
        sm__cycles_elapsed) metrics+="$m.avg.per_second," ;;
        *) metrics+="$m.avg.pct_of_peak_sustained_elapsed," ;;
      esac
    done
    cd benchmarks
    for case in "$@"; do
      kernel=${case#*:} case=${case%%:*}
      timeout 150 ncu --clock-control none -k "regex:$kernel" --launch-skip 3 --launch-count 1 --csv \
        --metrics "${metrics%,}" python3 profile_launch.py "$case" 2>&1 | grep -v "^==PROF==" > "$OUT/$case.csv"
      python3 -c 'import csv, sys
for r in csv.DictReader(l for l in open(sys.argv[1]) if l.startswith("\"")):
    print(r["Kernel Name"][:40], r["Metric Name"], r["Metric Unit"], r["Metric Value"])' "$OUT/$case.csv"
    done ;;
  profile-gemm)  # the warp-specialized Gluon GEMM and cuBLAS at M=4096, (4096, 7168): pipes, memory, stalls
    cd benchmarks
    for case in gemm-ws:fp8_gemm_ws gemm-4096:nvjet\|sm90\|cutlass\|xmma; do
      kernel=${case#*:} case=${case%%:*}
      timeout 150 ncu --clock-control none -k "regex:$kernel" --launch-skip 3 \
        --launch-count 1 --section SourceCounters --section WarpStateStats --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section LaunchStats \
        --section Occupancy -f -o "$OUT/$case" python3 profile_launch.py "$case" 2>&1 | grep -v "^==PROF==" | tail -3
      ncu --import "$OUT/$case.ncu-rep" --page details --csv > "$OUT/${case}_details.csv"
      ncu --import "$OUT/$case.ncu-rep" --page source --csv --print-source sass > "$OUT/$case.csv"
      python3 stall_ledger.py "$OUT/$case.csv" 2>&1 | head -12
      grep -E '"(Kernel Name|Duration|SM Frequency|Grid Size|Block Size|Cluster Size|Registers Per Thread|Memory Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Executed Ipc Active)"' \
        "$OUT/${case}_details.csv" | awk -F'","' '{print $(NF-2)": "$NF}' | head -14
    done ;;
  *) echo "usage: OUT=<dir> bash benchmarks/h200_run.sh conformance|model|prefix-cache|v4-graphs|v4-bench|dsa-check|dsa-bench|bench|tiles|scores-first|gemm-tiles|gluon-ws|ab|ab-set|ep|ep-check|gemm-invariant|profile|throughput|profile-gemm" >&2
     exit 2 ;;
esac
