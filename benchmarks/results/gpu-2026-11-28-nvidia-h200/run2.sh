#!/usr/bin/env bash
# The second call on the 2026-11-28 H200 (after run 1 = `bash benchmarks/gpu_suite.sh --old-src ...`):
# the steps run 1 cut short or that the fused LM head (7ef2dfc) changes, each under its own limit.
#   bash benchmarks/results/gpu-2026-11-28-nvidia-h200/run2.sh OUT_FOLDER
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=src:benchmarks
O=${1:-/tmp/g2}; mkdir -p "$O/logs"
R=benchmarks/results
step() {
  local name=$1 lim=$2; shift 2
  echo "[$(date +%T)] $name (limit $lim s): $*" >> "$O/run.log"; local t=$SECONDS
  timeout -k 5 "$lim" "$@" > "$O/logs/$name.log" 2>&1
  echo "    rc=$? $((SECONDS - t)) s" >> "$O/run.log"
}
step verify 45 bash -c "python3 -m lengthwise verify --model-config tiny-qwen --device cuda --dtype bfloat16 \
  --backend varlen --lengths 200,30,17,60,5 --chunk-size 64 --k 1 --json > $O/verify.json"
step profile-0.5b 55 python3 -m lengthwise profile --model qwen2.5-0.5b --max-tokens 16384 --repeats 2 \
  --out "$O/profile-qwen2.5-0.5b.json"
P=$O/profile-qwen2.5-0.5b.json; [ -s "$P" ] || P=$R/gpu-2026-11-28-nvidia-h200/profile-qwen2.5-0.5b.json
step finetune-0.5b-32k 100 python3 benchmarks/bench_gpu_finetune.py --models qwen2.5-0.5b --contexts 32768 \
  --steps 2 --warmup 1 --systems packing,packing:eager,chunkflow --no-scan --profile-file "qwen2.5-0.5b=$P" \
  --out "$O/finetune-0.5b-32k.json"
step finetune-1.5b-32k 110 python3 benchmarks/bench_gpu_finetune.py --models qwen2.5-1.5b --contexts 32768 \
  --steps 2 --warmup 1 --systems packing,chunkflow --chunk-size 8192 --no-scan \
  --profile-file "qwen2.5-1.5b=$R/h200-2026-11-27/profile-qwen2.5-1.5b.json" --out "$O/finetune-1.5b-32k.json"
step sim-fidelity-0.5b-32k 60 python3 benchmarks/sim_fidelity.py --model qwen2.5-0.5b --context 32768 \
  --batches 3 --repeats 2 --profile-file "$P" --out "$O/sim-fidelity-0.5b-32k.json"
step host-overhead 50 python3 benchmarks/bench_host_overhead.py --device cuda --variants after,after+compile \
  --rounds 3 --steps 5 --out "$O/host-overhead-compile.json"
step finetune-0.5b-128k-long 70 python3 benchmarks/bench_gpu_finetune.py --models qwen2.5-0.5b --contexts 131072 \
  --steps 1 --warmup 1 --systems chunkflow --chunk-size 8192 --long-sequence 65536-131072 --no-scan \
  --profile-file "qwen2.5-0.5b=$P" --out "$O/finetune-0.5b-128k-long-chunkflow.json"
echo "done $(date +%T)" >> "$O/run.log"
