#!/usr/bin/env bash
# The H200 measurements, in two device calls of under 10 minutes each (device tool: carry .whl).
#   bash packaging/bench/h200.sh 1   # GPU tests, 27B-shape speed (eager vs graphs), 80B-A3B slice, demo model
#   bash packaging/bench/h200.sh 2   # sampling speed, precision report, multi-turn TTFT on the 27B shape
# Results land in $OUT (copy them to packaging/bench/ and rerun packaging/bench/table.py for the README).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bench() { python3 -m app.cli bench "$@" 2>&1 | tail -25; }
case "${1:-1}" in
1)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
  bench --random-weights qwen3.5-27b --depths 0,1,3 --drafter oracle --acceptance 1.0,0 --max-new-tokens 64 \
        --repeat 2 --out "$OUT/bench27b.json"
  bench --random-weights qwen3-next-80b-a3b --layers 12 --depths 0,1,3 --drafter oracle --acceptance 1.0,0 \
        --max-new-tokens 64 --repeat 2 --out "$OUT/bench80b_a3b_12layers.json"
  bench --model engine/assets/demo --depths 0,1,2,3 --acceptance 1.0,0.5,0 --max-new-tokens 128 --repeat 3 \
        --out "$OUT/bench_demo_gpu.json"
  ;;
2)
  bench --model engine/assets/demo --depths 0,1,2,3 --drafter mtp --temperature 0.7 --top-p 0.9 \
        --max-new-tokens 128 --repeat 3 --no-hf --out "$OUT/bench_demo_gpu_t07.json"
  bench --precision --model engine/assets/demo --depths 3 --max-new-tokens 64 --out "$OUT/precision_demo_gpu.json"
  bench --precision --random-weights qwen3.5-27b --layers 16 --depths 3 --max-new-tokens 32 \
        --out "$OUT/precision_27b_16layers_gpu.json"
  python3 packaging/bench/turns.py --random-weights qwen3.5-27b --turns 10 --history-tokens 2000 \
        --json "$OUT/turns_27b_gpu.json" 2>&1 | tail -8
  ;;
esac
