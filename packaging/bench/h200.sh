#!/usr/bin/env bash
# The H200 measurements, as device calls of under 10 minutes each (device tool: carry .whl; `distill` also
# carries packaging/demo_model/build/upload and packaging/demo_model/build/trained/{config,train_log}.json).
#   bash packaging/bench/h200.sh distill  # the demo model's MTP head distillation (then export + evaluate on a CPU)
#   bash packaging/bench/h200.sh speed    # 27B shape eager / graphs / graphs+compile with the oracle, GPU tests
#   bash packaging/bench/h200.sh speed2   # 27B shape with the MTP head, 80B-A3B slice
#   bash packaging/bench/h200.sh profile  # kernels of one 27B-shape decode step
#   bash packaging/bench/h200.sh cycle    # the demo model's decoding cycles: wall vs GPU busy, kernels per cycle
#   bash packaging/bench/h200.sh ops      # decode attention and conv variants, per call, inside CUDA graphs
#   bash packaging/bench/h200.sh tp       # nvidia-h200-x2: --tp 1 vs the plain engine, 27B and 80B-A3B at --tp 2
#   bash packaging/bench/h200.sh turns    # multi-turn TTFT on the 27B shape
#   bash packaging/bench/h200.sh demo     # the demo model: greedy and sampled speed, precision report
#   bash packaging/bench/h200.sh demo-compile  # the same model with --compile: speed and precision
#   bash packaging/bench/h200.sh fp8      # FP8 kernels per call (fp8_ops.py), 27B shape FP8 vs bf16, GPU tests
#   bash packaging/bench/h200.sh attn     # decoding after long prompts with the split-K decode attention
#   bash packaging/bench/h200.sh int4     # the W4A16 kernel's GPU tests, 27B shape Int4 speed, memory at 32k context
#   bash packaging/bench/h200.sh where    # where a 27B-shape step's time goes: bf16 and FP8, eager and --compile
#   bash packaging/bench/h200.sh draft    # draft models' cost per cycle on the 27B shape; FP8 routed-expert kernels
#   bash packaging/bench/h200.sh kernels  # every quantized kernel form per call (quant_kernels.py), their GPU tests,
#                                         # 27B shape Int4 and FP8 speed
#   bash packaging/bench/h200.sh prefill  # 27B shape: prefill tok/s, TTFT, peak memory, decode at 200 .. 131072
#                                         # prompt tokens; the demo model's MTP acceptance against context length
#   bash packaging/bench/h200.sh auto     # compiled-graph and quantized-kernel GPU tests; 27B shape --compile: auto
#                                         # against fixed depths at the flat, realistic and changing profiles
#   bash packaging/bench/h200.sh quant    # GPU tests; 27B shape Int4 --compile; FP8 and bf16 prefill of 8k prompt tokens
#   bash packaging/bench/h200.sh moe4     # the 4-bit routed-expert kernels' GPU tests; 80B-A3B 12-layer slice in Int4
#   bash packaging/bench/h200.sh int4rows # the CUDA-core W4A16 form per call; GPU tests; 27B shape Int4 --compile
#   bash packaging/bench/h200.sh memory   # what holds the 27B shape's Int4 memory at a 32k prompt's peak (a 32k
#                                         # --max-context); FLA's chunked prefill kernel whole or in slices
#   bash packaging/bench/h200.sh gdn      # the GDN recurrent kernel's launch configurations per call (gdn_ops.py)
#   bash packaging/bench/h200.sh moe      # the routed-expert kernels' configurations per call (moe_configs.py),
#                                         # their GPU tests; the whole 80B-A3B shape in FP8, compiled
#   bash packaging/bench/h200.sh gemv     # the FP8 kernels streaming 16-bit weights against cuBLAS at the 80B's and
#                                         # 27B's bf16 linears (quant_kernels.py --quant bf16); FP8 precision, demo
#   bash packaging/bench/h200.sh linear16 # those kernels in the engine against cuBLAS (MTPCHAT_LINEAR16=cublas), end
#                                         # to end: the 80B-A3B slice in bf16, the whole 80B-A3B in FP8
#   bash packaging/bench/h200.sh linear16b  # the same on the 27B shape, bf16 and FP8
#   bash packaging/bench/h200.sh linear16c  # their GPU test; the 27B shape in Int4 with them (its bf16 lm_head, b + a)
#   bash packaging/bench/h200.sh bits     # FP8 GPU tests; the FP8 kernels per call (dotbits: the tensor-core form
#                                         # without conversion instructions) at 1 and 4 rows; 27B shape FP8 --compile
#   bash packaging/bench/h200.sh suite [GROUP ...]  # test modules on a CUDA host, a process per group of them
#   bash packaging/bench/h200.sh moe80    # the 4-bit routed-expert kernels' GPU tests; the 80B-A3B 12-layer slice in
#                                         # Int4; the whole 80B-A3B in FP8, compiled
#   bash packaging/bench/h200.sh pdl      # programmatic dependent launch (MTPCHAT_PDL=0 / ours / both): GPU tests of
#                                         # the kernels; the 80B-A3B 12-layer slice, bf16 --compile, each way in turn
#   bash packaging/bench/h200.sh pdl2     # the same on the 27B shape (bf16 --compile, PDL both / 0) and the whole
#                                         # 80B-A3B in FP8 (--compile, PDL both)
#   bash packaging/bench/h200.sh pdltests # the GPU tests of every kernel launched with PDL, compiled graphs included
#   bash packaging/bench/h200.sh hbm      # the GPU's achievable read bandwidth (hbm_read.py)
#   bash packaging/bench/h200.sh stream   # the one-row stream form per call against the others and cuBLAS (bf16 and
#                                         # FP8 weights, the 27B shape's); the 27B shape bf16 and FP8 --compile
#   bash packaging/bench/h200.sh stream2  # its GPU tests; the 27B shape in bf16, the whole 80B-A3B in FP8, the 80B-A3B
#                                         # slice in bf16, --compile
#   bash packaging/bench/h200.sh where80  # kernels of one 80B-A3B slice step (bf16, --compile, the 16-bit Triton
#                                         # linears); the demo model's cycles: wall vs GPU busy
#   bash packaging/bench/h200.sh ahead    # every one-row form per call (Int4 row with its staged configurations,
#                                         # FP8 and 16-bit stream)
#   bash packaging/bench/h200.sh ahead27b # the 27B shape in Int4 and FP8, --compile, depths 0 and 3
#   bash packaging/bench/h200.sh cycles   # the demo model with cycle graphs and without (MTPCHAT_CYCLE_GRAPHS=0);
#                                         # GPU tests; with cycle graphs and --compile
#   bash packaging/bench/h200.sh demo57   # the float32 GPU tests under faulthandler; the demo's cycles with the gated
#                                         # norm, its bench rows with auto
#   bash packaging/bench/h200.sh auto57   # eager attention's GPU test; auto_trace.py on the demo model (auto cycle
#                                         # by cycle after fixed depths)
#   bash packaging/bench/h200.sh verify57 # GPU tests; the demo's cycles and rows with auto; the 80B-A3B slice
#   bash packaging/bench/h200.sh bits58   # FP8's one-row stream form without conversions (streambits): its GPU tests,
#                                         # per-shape times, the 27B shape in FP8 --compile at depths 0 and 3
#   bash packaging/bench/h200.sh demo58   # the demo's cycles and bench rows with auto; the 80B-A3B slice
#   bash packaging/bench/h200.sh auto58   # --depth auto on the demo model with the head's padded catch-up graphs
#   bash packaging/bench/h200.sh auto59   # stop 59's chooser (a probe from plain decoding pays the switch): the demo
#                                         # model's auto trace and bench rows, then the 27B shape's auto rows
#   bash packaging/bench/h200.sh auto60    # stop 60: the 27B shape's auto rows (stop 59's chooser), AUTO_LIMIT seconds
#   bash packaging/bench/h200.sh conv60    # stop 60: the demo model and the 27B shape (uncompiled)
#                                         # with the short conv as one kernel and without (A/B)
#   bash packaging/bench/h200.sh fp8x61    # stop 61 (H200 only): the whole 80B-A3B in FP8, graphs then --compile
#   bash packaging/bench/h200.sh conv61    # stop 61: the short conv's and add+norm's GPU tests, engine-level ones included
#   bash packaging/bench/h200.sh rope62    # stop 62: the rotary embedding's kernels' GPU tests; the demo model with them
#                                         # and without (MTPCHAT_ROPE=torch), A/B in one call
#   bash packaging/bench/h200.sh rope62b   # stop 62: the 27B shape (uncompiled: the chat's default) with and without them
#   bash packaging/bench/h200.sh swiglu62  # stop 62: the SwiGLU kernel's GPU tests; the demo model with it and without
#                                         # (MTPCHAT_SWIGLU=torch); the demo's cycle profile; probes' acceptance
#   bash packaging/bench/h200.sh stop63    # stop 63: the demo's auto rows with the climb from a probe's depth, SwiGLU's
#                                         # GPU tests with rope's and conv's install tests, the cycle profile per kernel
#   bash packaging/bench/h200.sh stop63b   # stop 63: the demo after the one gather over Qwen3-Next's GDN projections
#                                         # (plain, depth 3, auto, the cycle profile), then the graph tests
#   bash packaging/bench/h200.sh stop65    # stop 65: stop64's case with the cycle graph's commit as two Triton kernels
#   bash packaging/bench/h200.sh auto65    # auto's plain cycles against plain decoding on the demo (auto_overhead.py)
#   bash packaging/bench/h200.sh stop67    # stop 67: auto_overhead.py (PROBE_MAX 128 against 64, auto's cycles traced), the
#                                         # demo's rows at depths 0, 3 and auto; then on an H200 fp8x62's records
#   bash packaging/bench/h200.sh ab67      # stop 67: auto_ab.py (plain, depth 3, auto with PROBE_MAX 64 and 128, 40 rounds)
#   bash packaging/bench/h200.sh switch67  # stop 67: the graph tests after the switch's change, auto_ab.py, the demo's rows
#   bash packaging/bench/h200.sh auto67    # stop 67: auto_ab.py, then auto_overhead.py
#   bash packaging/bench/h200.sh gdn68     # stop 68: our GDN recurrence for a few tokens: GPU tests, demo A/B, cycle profile
#   bash packaging/bench/h200.sh demo68    # stop 68: the demo's rows at depths 0-4 and auto, then auto_ab.py
#   bash packaging/bench/h200.sh records68 # stop 68 (H200): #23's 80B-A3B in FP8 and #28's 27B in bf16, compiled
#   bash packaging/bench/h200.sh stop69    # stop 69: the demo's rows at depths 0-4 and auto, then auto_ab.py: auto
#                                         # without FALL_DOUBT (A) against with it (B, the default)
#   bash packaging/bench/h200.sh demo69    # the same shorter (under 5 minutes on a warm machine), then reply_overhead.py
#   bash packaging/bench/h200.sh cycle69   # stop 69: fewer launches in a cycle graph: GPU tests, the demo's rows, the profile
#   bash packaging/bench/h200.sh stop71    # on an H200 the new kernels' GPU tests and the records (records67), else demo71
#   bash packaging/bench/h200.sh demo71    # stops 69-71: the cycle graphs' and new kernels' GPU tests, the demo's rows, its
#                                         # kernel choices and cycle profile, the 16-bit forms at its shapes (wide rows)
#   bash packaging/bench/h200.sh stop66    # stop 66: auto_overhead.py (plain picks held); then on an H200 fp8x62's records,
#                                         # elsewhere the demo's rows at depths 0-3 and auto
#   bash packaging/bench/h200.sh stop66b   # the same's first two parts alone (under 5 minutes)
#   bash packaging/bench/h200.sh stop64    # stop 64: the demo with its GDN projections in order at load and the split-K
#                                         # attention's merge kernel (its choice, rows, cycle profile, GPU tests)
#   bash packaging/bench/h200.sh fp8x62    # stop 62 (H200 only): the whole 80B-A3B in FP8 --compile (the rope table now
#                                         # one launch a pass outside the compiled blocks), then the 27B shape bf16 --compile
#   bash packaging/bench/h200.sh kvfp8    # --kv-cache-dtype fp8: its GPU tests, the 27B shape's Int4 32k peak with
#                                         # it, Int4 decoding after an 8k prompt with and without it; FLA's chunked
#                                         # kernel whole or in slices
# .whl must hold flash-linear-attention, fla-core, platformdirs and pytest (+ pluggy, iniconfig, packaging):
# the device's python3 has none of them.
# Results land in $OUT (copy them to packaging/bench/ and rerun packaging/bench/table.py for docs/benchmarks.md).
set -uo pipefail
[ -d /tmp/site/fla ] && [ -d /tmp/site/_pytest ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bench() { timeout -k 10 "${BENCH_TIMEOUT:-300}" python3 -m app.cli bench "$@" 2>&1 | tail -25; }
# pytest under a time limit: SIGINT, so that it still prints its summary (SIGTERM left nothing); the whole log in
# $OUT, its failures and summary here
gpu_tests() {
  local limit=$1 log=$2; shift 2
  timeout -k 15 -s INT "$limit" python3 -m pytest -p no:cacheprovider -rf "$@" > "$log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|No module" "$log" | tail -20
}
# stop 67's records where this is an H200 (#23's 80B-A3B in FP8, then as time allows #28's 27B in bf16, both
# --compile); $1: the second of the call by which the 80B-A3B's bench must end
records67() {
  nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || return 0
  BENCH_TIMEOUT=$(($1 - SECONDS)) bench --random-weights qwen3-next-80b-a3b --quant fp8 --compile --depths 0,3 \
      --drafter oracle --acceptance 1.0 --max-new-tokens 48 --repeat 2 --no-hf --out "$OUT/bench80b_fp8_compile67_h200.json" \
      | grep -E "none|oracle|HBM|rror"
  [ $SECONDS -lt 380 ] && BENCH_TIMEOUT=$((585 - SECONDS)) bench --random-weights qwen3.5-27b --compile --depths 0,3 \
      --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_compile67_h200.json" \
      | grep -E "none|oracle|HBM|rror"
}
case "${1:-speed}" in
speed)  # about 6 minutes
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  bench --random-weights qwen3.5-27b --compile --depths 0,1,3 --drafter oracle --acceptance 1.0,0 \
        --max-new-tokens 64 --repeat 2 --out "$OUT/bench27b_compile_h200.json"
  gpu_tests 230 "$OUT/gpu_tests.log" tests/test_gpu.py
  ;;
speed2)  # the MTP rows at a real shape (random weights: their acceptance is meaningless; the head's refresh and
  # draft times are what they measure), and the 80B-A3B slice
  bench --random-weights qwen3.5-27b --compile --depths 0,1,3 --drafter mtp --max-new-tokens 64 --repeat 2 --no-hf \
        --out "$OUT/bench27b_mtp_h200.json"
  bench --random-weights qwen3-next-80b-a3b --layers 12 --compile --depths 0,1,3 --drafter oracle \
        --acceptance 1.0,0 --max-new-tokens 64 --repeat 2 --out "$OUT/bench80b_a3b_12layers_h200.json"
  ;;
profile)
  timeout 150 python3 packaging/bench/profile_step.py --random-weights qwen3.5-27b --compile --json "$OUT/profile27b.json" --host 256 2>&1 | grep -v Warn | tail -90
  ;;
cycle)
  timeout 150 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --json "$OUT/cycle_demo_h200.json" 2>&1 | grep depth
  ;;
ops)
  timeout 120 python3 packaging/bench/decode_ops.py 2>&1 | grep -E "^(attn|conv)" | tee "$OUT/decode_ops.txt"
  ;;
distill)  # the demo model's MTP head, self-distilled from its frozen trunk (packaging/demo_model/distill.py)
  # engine/assets/demo/model.safetensors holds build/trained's trunk bit for bit (and the head distilled so far,
  # which this run continues from): carry only build/trained's config.json and train_log.json, and build/upload
  # (the 64 MiB limit on what travels)
  mkdir -p /tmp/trained && cp packaging/demo_model/build/trained/*.json /tmp/trained/
  ln -sf "$PWD/engine/assets/demo/model.safetensors" /tmp/trained/weights-0.safetensors
  # more on-policy replies (100 s of generation) instead of more epochs over fewer, and more weight on the head's
  # first step, whose top-1 agreement is depth 1's acceptance
  timeout 330 python3 packaging/demo_model/distill.py --model /tmp/trained \
        --data packaging/demo_model/build/upload --out /tmp/distilled --minutes 5.2 --gen-max-s 100 \
        --gen-seqs 98304 --ce-weight 0.3 --chain-weight 0.4 --lr 3e-4 2>&1 | tail -12
  # only the head changed: bring back its tensors and the logs (the trunk is build/trained's, bit for bit)
  cp /tmp/distilled/distill_log.json /tmp/distilled/distill.csv "$OUT/"
  python3 -c "import glob,safetensors.torch as st; st.save_file({k: v for f in glob.glob('/tmp/distilled/weights-*.safetensors') for k, v in st.load_file(f).items() if k.startswith('mtp.')}, '$OUT/mtp_distilled.safetensors')"
  ;;
tp)  # #8 on nvidia-h200-x2 (NVLink multicast off: NCCL_NVLS_ENABLE=0 above)
  # --tp 1 through torch.distributed (one torchrun rank: process group, sharded loader, collectives captured in
  # the graphs) against the plain engine, same flags
  one="--random-weights qwen3.5-27b --compile --depths 0 --max-new-tokens 32 --repeat 3 --no-hf"
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m app.cli bench $one --out "$OUT/bench27b_plain_h200.json" 2>&1 | tail -6 &
  CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -m torch.distributed.run --nproc-per-node 1 -m app.cli bench $one \
        --out "$OUT/bench27b_tp1_h200.json" 2>&1 | tail -6
  wait
  timeout 200 python3 -m app.cli bench --tp 2 --random-weights qwen3.5-27b --compile --depths 0,1,3 \
        --drafter oracle --acceptance 1.0,0 --max-new-tokens 64 --repeat 2 --out "$OUT/bench27b_tp2_h200.json" 2>&1 | tail -10
  timeout 265 python3 -m app.cli bench --tp 2 --random-weights qwen3-next-80b-a3b --compile --depths 0,1,3 \
        --drafter oracle --acceptance 1.0,0 --max-new-tokens 48 --repeat 2 --out "$OUT/bench80b_a3b_tp2_h200.json" 2>&1 | tail -14
  ;;
turns)
  timeout 200 python3 packaging/bench/turns.py --random-weights qwen3.5-27b --turns 10 --history-tokens 2000 \
        --json "$OUT/turns_27b_gpu.json" 2>&1 | tail -8
  ;;
demo)
  bench --model engine/assets/demo --depths 0,1,2,3 --acceptance 1.0,0.5,0 --max-new-tokens 128 --repeat 3 \
        --out "$OUT/bench_demo_gpu.json"
  bench --model engine/assets/demo --depths 0,1,2,3 --drafter mtp --temperature 0.7 --top-p 0.9 \
        --max-new-tokens 128 --repeat 3 --no-hf --out "$OUT/bench_demo_gpu_t07.json"
  bench --precision --model engine/assets/demo --depths 3 --max-new-tokens 128 --out "$OUT/precision_demo_gpu.json"
  ;;
demo-compile)  # the demo model with --compile: speed, and what compiling costs bf16 agreement between depths
  bench --model engine/assets/demo --compile --depths 0,1,2,3 --drafter mtp --no-hf --max-new-tokens 128 --repeat 3 \
        --out "$OUT/bench_demo_gpu_compile.json"
  bench --precision --compile --model engine/assets/demo --depths 3 --max-new-tokens 128 \
        --out "$OUT/precision_demo_gpu_compile.json"
  ;;
fp8)  # issue #23 (about 7 minutes)
  gpu_tests 200 "$OUT/fp8_gpu_tests.log" tests/test_fp8_triton.py tests/test_attention_triton.py tests/test_fp8.py \
        -k "kernel or cuda or split_k or row or install"
  timeout 150 python3 packaging/bench/fp8_ops.py --json "$OUT/fp8_ops27b_h200.json" 2>&1 | tail -60
  bench --random-weights qwen3.5-27b --quant fp8 --depths 0,3 --drafter oracle --acceptance 1.0 \
        --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_fp8_h200.json"
  bench --random-weights qwen3.5-27b --depths 0,3 --drafter oracle --acceptance 1.0 \
        --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_bf16_h200.json"
  ;;
attn)  # issue #22: decoding after 32 / 64k / 128k tokens, the split-K kernel against the masked form
  MTPCHAT_DECODE_ATTENTION=triton timeout 280 python3 packaging/bench/prefill_ops.py --graphs 65536,131072 --quick \
        --json "$OUT/decode_long_triton_h200.json" 2>&1 | grep -E "after|attention|N\"" | tail -12
  ;;
prefill)  # issue #22 items 5-6 (about 8 minutes; the 27B shape's 131072-token prefill alone is tens of seconds a run)
  timeout 420 python3 -m app.cli bench --random-weights qwen3.5-27b --prompt-tokens 200,2048,8192,32768,65536,131072 \
        --depths 0 --max-new-tokens 32 --repeat 1 --no-hf --out "$OUT/prefill27b_h200.json" 2>&1 | tail -12
  # up to the demo model's 4096 positions: 4000 prompt tokens + 96 new ones
  timeout 150 python3 -m app.cli bench --model engine/assets/demo --prompt-tokens 128,1024,2048,4000 --depths 0,1,2,3 \
        --drafter mtp --max-new-tokens 96 --no-hf --out "$OUT/accept_ctx_demo.json" 2>&1 | tail -20
  ;;
kernels)  # issues #29 / #23 (about 9 minutes)
  timeout 200 python3 packaging/bench/quant_kernels.py --json "$OUT/quant_kernels_h200.json" 2>&1 \
        | grep -E "rows [0-9]+:" | tee "$OUT/quant_kernels.txt"
  gpu_tests 150 "$OUT/kernel_gpu_tests.log" tests/test_int4.py tests/test_fp8_triton.py \
        -k "kernel or cuda or alone or fp8_x_fp8 or quantizer or install or split_k"
  BENCH_TIMEOUT=170 bench --random-weights qwen3.5-27b --quant int4 --depths 0,3 --drafter oracle --acceptance 1.0 \
        --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_int4_h200.json"
  BENCH_TIMEOUT=150 bench --random-weights qwen3.5-27b --quant fp8 --depths 0,3 --drafter oracle --acceptance 1.0 \
        --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_fp8_h200.json"
  ;;
moe)  # issues #23 / #28 (about 9 minutes)
  timeout 250 python3 packaging/bench/moe_configs.py --json "$OUT/moe_configs_h200.json" 2>&1 | grep -v Warn | tail -30
  gpu_tests 150 "$OUT/moe_gpu_tests.log" tests/test_moe_triton.py tests/test_fp8_moe.py \
        -k "batch or every_down or kernel or rowwise or graph or compiles"
  BENCH_TIMEOUT=330 bench --random-weights qwen3-next-80b-a3b --quant fp8 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 48 --repeat 2 --no-hf --out "$OUT/bench80b_fp8_compile_h200.json"
  ;;
int4)  # issue #29 (about 4 minutes)
  gpu_tests 120 "$OUT/int4_gpu_tests.log" tests/test_int4.py -k "kernel or cuda"
  bench --random-weights qwen3.5-27b --quant int4 --depths 0,3 --drafter oracle --acceptance 1.0 \
        --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_int4_h200.json"
  bench --random-weights qwen3.5-27b --quant int4 --prompt-tokens 32768 --depths 0 --max-new-tokens 16 \
        --repeat 1 --no-hf --out "$OUT/int4_32k_h200.json"
  ;;
where)  # issues #23 / #28: kernels of one decode step, FP8 eager and compiled, bf16 compiled; FP8 linears at
  # prefill widths (about 5 minutes)
  for run in "fp8" "fp8 --compile" "bf16 --compile"; do
    set -- $run
    echo "== $run"
    timeout 170 python3 packaging/bench/profile_step.py --random-weights qwen3.5-27b --quant $1 ${2:-} \
        --json "$OUT/profile27b_$1${2:+_compile}.json" 2>&1 | grep -v Warn | tail -30
  done
  timeout 120 python3 packaging/bench/fp8_prefill_ops.py --json "$OUT/fp8_prefill_ops_h200.json" 2>&1 | tail -44
  ;;
draft)  # issue #27 (draft models) and #23 (FP8 routed experts), about 6 minutes. Random-weight drafts of the real
  # shapes (acceptance ~0): each draft row reports the draft's ms per cycle and share of it, a draft step against
  # plain's step, and the break-even acceptance. --compile compiles the draft's layers too (DraftModelDrafter.
  # for_target). Earlier runs: draft_h200.json (the script this replaced, uncompiled, after the Qwen3 norm fix: at
  # depth 3 the 0.6B shape 7.15 ms a cycle against a 19.3 ms verify, the hybrid 7.55 ms);
  # draft27b_qwen3-0.6b_compile_h200.json (--compile: 1.54 ms a draft step, 10.2% of the 15.1 ms plain step).
  for d in qwen3-0.6b qwen3.5-0.8b; do
    bench --random-weights qwen3.5-27b --compile --draft-model random:$d --drafter draft --depths 0,1,3 \
          --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/draft27b_${d}_h200.json"
  done
  timeout 90 python3 packaging/bench/fp8_moe_ops.py 2>&1 | tee "$OUT/fp8_moe_ops_h200.txt"
  ;;
auto)  # issue #28 (about 9 minutes): compiled-graph and quantized-kernel GPU tests, then the 27B shape
  gpu_tests 170 "$OUT/gpu_tests.log" tests/test_gpu.py tests/test_int4.py tests/test_fp8_triton.py \
        -k "compiled or certified or kernel or cuda or experts or split_k"
  BENCH_TIMEOUT=360 bench --random-weights qwen3.5-27b --compile --depths 0,2,3,4,auto --drafter oracle \
        --acceptance 1.0,0.5,0 --acceptance-profile "0.92,0.84,0.65,0.54;changing" --max-new-tokens 128 --repeat 2 \
        --no-hf --out "$OUT/auto27b_h200.json"
  ;;
quant)  # issues #29 / #23 / #28 (about 8.5 minutes)
  gpu_tests 120 "$OUT/gpu_tests.log" tests/test_gpu.py tests/test_int4.py tests/test_fp8_triton.py \
        -k "compiled or certified or kernel or cuda or experts or split_k"
  # (load 66 s and warm-up 95 s before the first row: 200 s was not enough)
  BENCH_TIMEOUT=320 bench --random-weights qwen3.5-27b --quant int4 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_int4_compile_h200.json"
  for q in fp8 bf16; do  # the prefill path with no graphs, as prefill8k_bf16_h200.json measured it
    BENCH_TIMEOUT=100 bench --random-weights qwen3.5-27b --quant $q --prompt-tokens 8192 --depths 0 --max-new-tokens 8 \
          --repeat 1 --no-hf --no-graphs --out "$OUT/prefill8k_${q}_h200.json"
  done
  ;;
moe4)  # issue #29 (about 4 minutes)
  gpu_tests 190 "$OUT/int4_moe_gpu_tests.log" tests/test_int4_moe_triton.py
  for moe in triton rowwise; do  # the fused 4-bit kernels, then each routed expert dequantized per call
    MTPCHAT_MOE=$moe BENCH_TIMEOUT=110 bench --random-weights qwen3-next-80b-a3b --layers 12 --quant int4 --depths 0,3 \
          --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf \
          --out "$OUT/bench80b_a3b_12layers_int4_${moe}_h200.json"
  done
  ;;
int4rows)  # issue #29 (about 8 minutes): the CUDA-core W4A16 form per call against the tensor-core ones, the
  # quantized kernels' GPU tests, 27B shape Int4 speed (--compile) after 32 and 32k prompt tokens
  timeout ${KERNEL_LIMIT:-150} python3 packaging/bench/quant_kernels.py --quant int4 --rows ${ROWS:-1,4} \
        --json "$OUT/quant_kernels_int4_h200.json" 2>&1 | grep -E "rows [0-9]+:|Error" | tee "$OUT/quant_kernels_int4.txt"
  gpu_tests ${TEST_LIMIT:-150} "$OUT/gpu_tests.log" tests/test_host_embedding.py tests/test_int4.py tests/test_fp8_triton.py \
        -k "kernel or cuda or experts or split_k or discovery or host or gpu"
  [ -n "${KERNELS_ONLY:-}" ] && exit 0
  # (auto places the embedding table in host memory: a quantized model)
  BENCH_TIMEOUT=${BENCH_TIMEOUT:-400} bench --random-weights qwen3.5-27b --quant int4 --compile --prompt-tokens 32,32768 \
        --depths 0,3 --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf \
        --out "$OUT/bench27b_int4_row_h200.json"
  ;;
ahead)  # issues #29 / #23 (about 3 minutes): the one-row forms per call, the Int4 row form's configurations staged
  # through shared memory (cp.async) among them
  timeout ${KERNEL_LIMIT:-240} python3 packaging/bench/quant_kernels.py --quant int4,fp8,bf16 --rows 1 \
        --json "$OUT/quant_kernels_ahead_h200.json" 2>&1 | grep -E "rows [0-9]+:|Error" | tee "$OUT/quant_kernels_ahead.txt"
  ;;
ahead27b)  # issues #29 / #23 (about 8 minutes): the 27B shape in Int4 and in FP8, --compile
  for q in int4 fp8; do
    BENCH_TIMEOUT=260 bench --random-weights qwen3.5-27b --quant $q --compile --depths 0,3 --drafter oracle \
          --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_${q}_ahead_h200.json"
  done
  ;;
memory)  # issue #29 (about 8 minutes): the GPU tests of the quantized paths and the graphs; what holds the 27B
  # shape's Int4 memory at a 32k prompt's peak after a chat's short turns at depths 0 and 3 (--compile)
  gpu_tests ${TEST_LIMIT:-200} "$OUT/gpu_tests.log" tests/test_gpu.py tests/test_int4.py tests/test_fp8.py \
        tests/test_fp8_triton.py tests/test_fp8_moe.py tests/test_host_embedding.py
  # FLA's chunked kernel over a 2,048-token chunk at once or in slices: time and intermediates (the 32k peak's next
  # block after the stash)
  timeout 60 python3 packaging/bench/gdn_prefill_split.py --json "$OUT/gdn_prefill_split_h200.json" 2>&1 | tail -5
  timeout 300 python3 packaging/bench/memory_peak.py --random-weights qwen3.5-27b --quant int4 --prompt-tokens 32768 \
        --compile --warm-depths 0,3 --json "$OUT/memory_peak_int4_32k_h200.json" 2>&1 | grep -v Warn | tail -30
  ;;
kvfp8)  # under 10 minutes: the fp8 KV cache (cache.py) on a GPU for the first time, the dequantized weight in
  # column blocks; FLA's chunked kernel whole or in slices; then, as time allows, the demo model's cycles (#28) and
  # the 8k decode with and without the fp8 cache
  gpu_tests 130 "$OUT/gpu_tests_kvfp8.log" tests/test_kv_fp8.py tests/test_attention_triton.py tests/test_gpu.py \
        tests/test_int4.py tests/test_fp8_triton.py tests/test_norm_triton.py \
        -k "fp8 or attention or block_of_columns or w4a16_kernel or lossless or graphs or gated"
  MTPCHAT_KV_CACHE_DTYPE=fp8 timeout 240 python3 packaging/bench/memory_peak.py --random-weights qwen3.5-27b \
        --quant int4 --prompt-tokens 32768 --compile --warm-depths 0,3 \
        --json "$OUT/memory_peak_int4_32k_fp8kv_h200.json" 2>&1 | grep -v Warn | tail -30
  timeout 40 python3 packaging/bench/gdn_prefill_split.py --json "$OUT/gdn_prefill_split_h200.json" 2>&1 | tail -5
  left() { echo $((570 - SECONDS)); }
  [ $(left) -gt 70 ] && BENCH_TIMEOUT=70 bench --model engine/assets/demo --depths 0,2,3,4 --drafter mtp \
        --max-new-tokens 256 --repeat 3 --no-hf --out "$OUT/bench_demo_cycles_1_h200.json"
  [ $(left) -gt 60 ] && timeout 60 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
        --json "$OUT/cycle_demo_cycles_h200.json" 2>&1 | grep depth
  for kv in auto fp8; do
    [ $(left) -gt 200 ] || break
    MTPCHAT_KV_CACHE_DTYPE=$kv BENCH_TIMEOUT=100 bench --random-weights qwen3.5-27b --quant int4 --compile \
        --depths 0,3 --drafter oracle --acceptance 1.0 --prompt-tokens 8192 --max-new-tokens 64 --no-hf \
        --out "$OUT/bench27b_int4_8k_kv${kv}_h200.json"
  done
  ;;
gdn)
  timeout 60 python3 packaging/bench/gdn_ops.py --json "$OUT/gdn_ops_h200.json" 2>&1 | grep -E "^B |Error"
  ;;
gemv)  # about 5 minutes
  timeout 200 python3 packaging/bench/quant_kernels.py --quant bf16 --shapes 80b --json "$OUT/quant_kernels_bf16_80b_h200.json" 2>&1 | tail -16
  timeout 200 python3 packaging/bench/quant_kernels.py --quant bf16 --shapes 27b --json "$OUT/quant_kernels_bf16_27b_h200.json" 2>&1 | tail -16
  gpu_tests 120 "$OUT/gpu_tests_gemv.log" tests/test_fp8_triton.py
  BENCH_TIMEOUT=200 bench --precision --quant fp8 --model engine/assets/demo --depths 3 --max-new-tokens 128 \
        --out "$OUT/precision_demo_fp8_h200.json"
  ;;
linear16)  # about 9 minutes
  gpu_tests 120 "$OUT/gpu_tests_linear16.log" tests/test_linear16_triton.py tests/test_fp8_triton.py
  for mode in cublas triton; do
    MTPCHAT_LINEAR16=$mode bench --random-weights qwen3-next-80b-a3b --layers 12 --compile --depths 0,3 \
        --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench80b_12l_linear16_${mode}_h200.json"
  done
  BENCH_TIMEOUT=330 bench --random-weights qwen3-next-80b-a3b --quant fp8 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 48 --repeat 2 --no-hf --out "$OUT/bench80b_fp8_linear16_h200.json"
  ;;
linear16b)  # about 9 minutes
  for mode in cublas triton; do
    MTPCHAT_LINEAR16=$mode bench --random-weights qwen3.5-27b --compile --depths 0 --max-new-tokens 64 --repeat 2 \
        --no-hf --out "$OUT/bench27b_linear16_${mode}_h200.json"
  done
  BENCH_TIMEOUT=250 bench --random-weights qwen3.5-27b --quant fp8 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_fp8_linear16_h200.json"
  ;;
linear16c)  # about 4 minutes
  gpu_tests 90 "$OUT/gpu_tests_linear16c.log" tests/test_linear16_triton.py
  BENCH_TIMEOUT=200 bench --random-weights qwen3.5-27b --quant int4 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_int4_linear16_h200.json"
  ;;
bits)  # about 7 minutes
  gpu_tests 90 "$OUT/gpu_tests_bits.log" tests/test_fp8_triton.py
  timeout 200 python3 packaging/bench/quant_kernels.py --quant fp8 --rows 1,4 \
        --json "$OUT/quant_kernels_fp8_dotbits_h200.json" 2>&1 | grep -v '^{' | tail -20
  BENCH_TIMEOUT=240 bench --random-weights qwen3.5-27b --quant fp8 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_fp8_dotbits_h200.json"
  ;;
cycles)  # issue #28: the demo model's cycles as one graph each, launched ahead of the host's read (about 8 minutes)
  # (first: which kernels a plain step and a depth-3 cycle launch, by name)
  timeout 100 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
        --json "$OUT/cycle_demo_cycles_h200.json" 2>&1 | grep depth
  for way in 1 0; do
    MTPCHAT_CYCLE_GRAPHS=$way bench --model engine/assets/demo --depths 0,2,3,4 --drafter mtp --max-new-tokens 256 \
          --repeat 3 --no-hf --out "$OUT/bench_demo_cycles_${way}_h200.json"
  done
  gpu_tests 150 "$OUT/gpu_tests.log" tests/test_gpu.py tests/test_host_embedding.py
  # compiled layers inside the graphs: fewer kernel nodes a cycle on a model this small
  BENCH_TIMEOUT=150 bench --model engine/assets/demo --compile --depths 0,2,3,4 --drafter mtp \
        --max-new-tokens 256 --repeat 3 --no-hf --out "$OUT/bench_demo_cycles_compile_h200.json"
  ;;
suite)  # the test modules that load engines, on a CUDA host, four processes at once (each ${SUITE_LIMIT:-500} s at
  # most): unmarked tests must pass there as in CI (CPU, float32), gpu-marked ones on the GPU. Logs: $OUT/g*.log
  groups=("${@:2}")
  [ ${#groups[@]} -gt 0 ] || groups=("tests/test_gpu.py tests/test_fp8_triton.py tests/test_fp8.py tests/test_host_embedding.py"
    "tests/test_exactness.py tests/test_reuse.py tests/test_chat_encoding.py"
    "tests/test_graphs.py tests/test_long_context.py tests/test_memory_fallbacks.py"
    "tests/test_draft_model.py tests/test_autodepth.py tests/test_thinking.py tests/test_bench.py tests/test_fp8_moe.py")
  for i in "${!groups[@]}"; do
    timeout -s INT "${SUITE_LIMIT:-500}" python3 -m pytest -p no:cacheprovider -q -rf ${groups[$i]} > "$OUT/g$i.log" 2>&1 &
  done
  wait
  for i in "${!groups[@]}"; do echo "== ${groups[$i]}"; grep -E "^(FAILED|ERROR)|passed|failed|rror" "$OUT/g$i.log" | tail -8; done
  ;;
where80)  # about 4 minutes
  timeout 200 python3 packaging/bench/profile_step.py --random-weights qwen3-next-80b-a3b --layers 12 --compile \
        --host 128 --json "$OUT/profile80b_12l_linear16_h200.json" 2>&1 | grep -v Warn | tail -60
  timeout 150 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --json "$OUT/cycle_demo_h200.json" 2>&1 | grep depth
  ;;
moe80)  # issues #23 / #29 (about 9 minutes)
  gpu_tests 120 "$OUT/int4_moe_gpu_tests.log" tests/test_int4_moe_triton.py
  BENCH_TIMEOUT=110 bench --random-weights qwen3-next-80b-a3b --layers 12 --quant int4 --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench80b_a3b_12layers_int4_triton_h200.json"
  BENCH_TIMEOUT=300 bench --random-weights qwen3-next-80b-a3b --quant fp8 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 48 --repeat 2 --no-hf --out "$OUT/bench80b_fp8_compile_v2_h200.json"
  ;;
pdl)  # issue #28 (about 8 minutes)
  gpu_tests 80 "$OUT/gpu_tests_pdl.log" tests/test_fp8_triton.py tests/test_moe_triton.py tests/test_linear16_triton.py \
        -k "cuda or graph or kernel"
  for pdl in 0 both ours both 0; do  # (both: MTPCHAT_PDL unset)
    [ $SECONDS -lt ${PDL_LIMIT:-480} ] || break
    if [ $pdl = both ]; then unset MTPCHAT_PDL; else export MTPCHAT_PDL=$pdl; fi
    BENCH_TIMEOUT=150 bench --random-weights qwen3-next-80b-a3b --layers 12 --compile --depths 0,3 --drafter oracle \
          --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench80b_12l_pdl_${pdl}_$SECONDS.json" \
          | grep -E "compile|HBM"
  done
  ;;
pdl2)  # issues #23 / #28 (about 8 minutes)
  for pdl in both 0; do
    if [ $pdl = both ]; then unset MTPCHAT_PDL; else export MTPCHAT_PDL=$pdl; fi
    BENCH_TIMEOUT=150 bench --random-weights qwen3.5-27b --compile --depths 0,3 --drafter oracle --acceptance 1.0 \
          --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_pdl_${pdl}_h200.json" | grep -E "compile|HBM"
  done
  unset MTPCHAT_PDL
  BENCH_TIMEOUT=280 bench --random-weights qwen3-next-80b-a3b --quant fp8 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 48 --repeat 2 --no-hf --out "$OUT/bench80b_fp8_pdl_both_h200.json" | grep -E "compile|HBM"
  ;;
pdltests)  # about 6 minutes
  gpu_tests ${TEST_LIMIT:-330} "$OUT/gpu_tests_pdl.log" tests/test_pdl.py tests/test_gpu.py tests/test_attention_triton.py \
        tests/test_norm_triton.py tests/test_moe_triton.py tests/test_fp8_triton.py tests/test_linear16_triton.py
  TEST_LIMIT=90 gpu_tests 90 "$OUT/gpu_tests_pdl_int4.log" tests/test_int4.py -k "kernel or cuda"
  ;;
hbm)  # the GPU's achievable read bandwidth (seconds)
  timeout 60 python3 packaging/bench/hbm_read.py --json "$OUT/hbm_read_h200.json" 2>&1 | tail -3
  ;;
stream)  # issues #28 / #23 (about 9 minutes)
  timeout 120 python3 packaging/bench/quant_kernels.py --quant bf16 --rows 1 \
        --json "$OUT/quant_kernels_bf16_stream_h200.json" 2>&1 | grep -E "ms over|lm_head"
  BENCH_TIMEOUT=150 bench --random-weights qwen3.5-27b --compile --depths 0,3 --drafter oracle --acceptance 1.0 \
        --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_stream_h200.json" | grep -E "compile|HBM"
  timeout 100 python3 packaging/bench/quant_kernels.py --quant fp8 --rows 1 \
        --json "$OUT/quant_kernels_fp8_stream_h200.json" 2>&1 | grep -E "ms over"
  BENCH_TIMEOUT=230 bench --random-weights qwen3.5-27b --quant fp8 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_fp8_stream_h200.json" \
        | grep -E "compile|HBM|rror"
  ;;
stream2)  # issues #28 / #23 (about 9 minutes): the kernels' GPU tests; the 27B shape bf16, the whole 80B-A3B in FP8
  # and the 80B-A3B 12-layer slice in bf16, --compile, with the stream form among the timed choices
  gpu_tests 70 "$OUT/gpu_tests_stream.log" tests/test_fp8_triton.py tests/test_linear16_triton.py tests/test_pdl.py \
        -k "cuda or graph or kernel or pdl"
  BENCH_TIMEOUT=240 bench --random-weights qwen3.5-27b --compile --depths 0,3 --drafter oracle --acceptance 1.0 \
        --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_stream_h200.json" | grep -E "compile|HBM|rror"
  BENCH_TIMEOUT=250 bench --random-weights qwen3-next-80b-a3b --quant fp8 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 48 --repeat 2 --no-hf --out "$OUT/bench80b_fp8_stream_h200.json" \
        | grep -E "compile|HBM|rror"
  [ $SECONDS -lt 440 ] && BENCH_TIMEOUT=130 bench --random-weights qwen3-next-80b-a3b --layers 12 --compile \
        --depths 0,3 --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf \
        --out "$OUT/bench80b_12l_stream_h200.json" | grep -E "compile|HBM|rror"
  ;;
demo57)  # stop 57: where the float32 GPU tests stop (faulthandler dumps every thread's stack), then the demo's cycles
  for t in "tests/test_gpu.py::test_fla_float32_speculation_equals_plain_and_cpu[q35]" \
           "tests/test_host_embedding.py::test_host_table_exact_in_graphs_and_off_the_gpu[float32]"; do
    timeout -k 5 -s INT 100 python3 -m pytest -p no:cacheprovider -x --tb=short -o faulthandler_timeout=50 "$t" \
          > "$OUT/hang_$(echo "$t" | md5sum | cut -c1-6).log" 2>&1
    echo "== $t rc=$?"; grep -E "File \"|Error|passed|failed|Timeout" "$OUT"/hang_$(echo "$t" | md5sum | cut -c1-6).log \
          | grep -v "/_pytest/\|/pluggy/" | head -40
  done
  timeout -k 5 70 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
        --json "$OUT/cycle_demo_gated_h200.json" 2>&1 | grep depth
  BENCH_TIMEOUT=80 bench --model engine/assets/demo --depths 0,2,3,4,auto --drafter mtp --max-new-tokens 256 \
        --repeat 3 --no-hf --out "$OUT/bench_demo_gated_h200.json" | grep -vE "^\s*$" | tail -12
  ;;
auto57)  # stop 57 (about 3 minutes): eager attention through the flash kernel (no SDPA dispatcher, no cuDNN plans
  # per shape), then --depth auto after fixed depths on the demo model, cycle by cycle; the bench's rows if time is left
  gpu_tests 150 "$OUT/gpu_tests_auto57.log" tests/test_gpu.py -k "fused_prefill or long_and_graph"
  timeout -k 5 100 python3 packaging/bench/auto_trace.py --depths 0,3,auto,auto --json "$OUT/auto_trace_flash.json" \
        2>&1 | grep -E "^depth|warm-up" | cut -c1-200
  [ $SECONDS -lt 100 ] && BENCH_TIMEOUT=$((175 - SECONDS)) bench --model engine/assets/demo --depths 0,2,3,auto \
        --drafter mtp --max-new-tokens 256 --repeat 2 --no-hf --out "$OUT/bench_demo_auto57.json" | grep -E "auto|mtp|none"
  ;;
verify57)  # stop 57's changes, measured (under 10 minutes): the GPU tests of graphs, norms and eager attention
  # (FLA's float32 autotuning alone takes minutes on a fresh machine); the demo model's cycles and bench rows with
  # auto (Qwen3-Next's projection gathers, the flash catch-up); the 80B-A3B 12-layer slice, bf16 --compile
  gpu_tests 300 "$OUT/gpu_tests_verify57.log" tests/test_gpu.py tests/test_norm_triton.py tests/test_host_embedding.py
  timeout -k 5 70 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
        --json "$OUT/cycle_demo_gathers.json" 2>&1 | grep depth
  BENCH_TIMEOUT=90 bench --model engine/assets/demo --depths 0,2,3,4,auto --drafter mtp --max-new-tokens 256 \
        --repeat 3 --no-hf --out "$OUT/bench_demo_gathers.json" | grep -E "auto|mtp|none"
  [ $SECONDS -lt 440 ] && BENCH_TIMEOUT=$((570 - SECONDS)) bench --random-weights qwen3-next-80b-a3b --layers 12 \
        --compile --depths 0,3 --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf \
        --out "$OUT/bench80b_12l_gathers.json" | grep -E "compile|HBM|rror"
  ;;
bits58)  # stop 58 (about 7 minutes): the streambits form's GPU tests (every byte exact: no flush of float32
  # subnormals), the seven 27B projections at one row per form, then the 27B shape in FP8 with the tuner choosing
  gpu_tests 150 "$OUT/gpu_tests_bits58.log" tests/test_fp8_triton.py
  timeout -k 5 150 python3 packaging/bench/quant_kernels.py --quant fp8 --rows 1 \
        --json "$OUT/quant_kernels_fp8_streambits.json" 2>&1 | grep "rows 1"
  BENCH_TIMEOUT=$((580 - SECONDS)) bench --random-weights qwen3.5-27b --quant fp8 --compile --depths 0,3 \
        --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf \
        --out "$OUT/bench27b_fp8_streambits.json"
  ;;
demo58)  # stop 58 (about 5 minutes on a warm machine): the demo model's cycles (Qwen3-Next's projection gathers) and
  # its bench rows with auto after the flash catch-up; the 80B-A3B slice if time is left
  timeout -k 5 150 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
        --json "$OUT/cycle_demo_gathers.json" 2>&1 | grep depth
  BENCH_TIMEOUT=200 bench --model engine/assets/demo --depths 0,2,3,4,auto --drafter mtp --max-new-tokens 256 \
        --repeat 3 --no-hf --out "$OUT/bench_demo_gathers.json"
  [ $SECONDS -lt 380 ] && BENCH_TIMEOUT=$((575 - SECONDS)) bench --random-weights qwen3-next-80b-a3b --layers 12 \
        --compile --depths 0,3 --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf \
        --out "$OUT/bench80b_12l_gathers.json"
  ;;
auto58)  # stop 58 (under 6 minutes): the MTP head's catch-up after plain steps as one padded graph replay
  # (graphs.padded_width): --depth auto on the demo model cycle by cycle, then the bench's rows with auto
  timeout -k 5 120 python3 packaging/bench/auto_trace.py --depths 0,3,auto,auto --json "$OUT/auto_trace_padded.json" \
        2>&1 | grep -E "^depth|warm-up" | cut -c1-200
  BENCH_TIMEOUT=$((330 - SECONDS)) bench --model engine/assets/demo --depths 0,2,3,4,auto --drafter mtp \
        --max-new-tokens 256 --repeat 3 --no-hf --out "$OUT/bench_demo_padded.json"
  ;;
auto59)  # stop 59 (under 10 minutes): --depth auto with the switch's cost (autodepth.DepthChooser.switch_ms) on the
  # demo model, cycle by cycle and as bench rows, then the 27B shape's profiles (bf16 --compile) if time is left
  timeout -k 5 120 python3 packaging/bench/auto_trace.py --depths 0,3,auto,auto --json "$OUT/auto_trace_switch.json" \
        2>&1 | grep -E "^depth|warm-up" | cut -c1-200
  BENCH_TIMEOUT=200 bench --model engine/assets/demo --depths 0,2,3,4,auto --drafter mtp --max-new-tokens 256 \
        --repeat 3 --no-hf --out "$OUT/bench_demo_switch.json" | grep -E "auto|mtp|none"
  [ $SECONDS -lt 300 ] && BENCH_TIMEOUT=$((585 - SECONDS)) bench --random-weights qwen3.5-27b --compile \
        --depths 0,2,3,4,auto --drafter oracle --acceptance 1.0,0.5,0 --acceptance-profile \
        "0.92,0.84,0.65,0.54;changing" --max-new-tokens 128 --repeat 2 --no-hf --out "$OUT/auto27b_switch.json" \
        | grep -E "compile|HBM|rror"
  ;;
auto60)  # stop 60 (AUTO_LIMIT seconds, default 330): the 27B shape's auto rows with stop 59's chooser (the switch's
  # cost; each reply from the prior) and the short-conv / add-norm kernels (--compile traces the torch forms)
  BENCH_TIMEOUT=${AUTO_LIMIT:-330} bench --random-weights qwen3.5-27b --compile --depths 0,2,3,4,auto --drafter oracle \
        --acceptance 1.0,0.5,0 --acceptance-profile "0.92,0.84,0.65,0.54;changing" --max-new-tokens 128 --repeat 2 \
        --no-hf --out "$OUT/auto27b_switch.json" | grep -E "compile|HBM|rror"
  ;;
conv61)  # stop 61 (about 5 minutes): conv_triton's and the add+norm kernel's GPU tests with the time the engine-level
  # ones need (stop 61's 120 s ran out while they compiled: only the kernel's value tests ran, 18 of 18 passed)
  gpu_tests ${TEST_LIMIT:-300} "$OUT/gpu_tests_conv61.log" tests/test_conv_triton.py tests/test_norm_triton.py
  ;;
fp8x61)  # stop 61 (needs an H200: 80 GB of FP8 weights): the whole 80B-A3B in FP8 in the chat's default (eager
  # steps in CUDA graphs, where stop 60's short-conv and add+norm kernels run), then --compile (the torch forms traced)
  for mode in graphs compile; do
    flag=$([ $mode = compile ] && echo --compile)
    [ $SECONDS -lt 300 ] && BENCH_TIMEOUT=$((570 - SECONDS)) bench --random-weights qwen3-next-80b-a3b --quant fp8 $flag \
          --depths 0,3 --drafter oracle --acceptance 1.0 --max-new-tokens 48 --repeat 2 --no-hf \
          --out "$OUT/bench80b_fp8_${mode}61_h200.json" | grep -E "none|oracle|HBM|rror"
  done
  ;;
rope62)  # stop 62 (about 7 minutes): rope_triton's GPU tests (bit-equality with the torch form included), then
  # the demo model's plain and MTP rows with the two rope kernels and without them, in one call
  gpu_tests ${TEST_LIMIT:-200} "$OUT/gpu_tests_rope62.log" tests/test_rope_triton.py
  for rope in triton torch; do
    [ $SECONDS -lt 420 ] && (export MTPCHAT_ROPE=$rope; BENCH_TIMEOUT=$((560 - SECONDS)) bench --model engine/assets/demo \
          --depths 0,2,3,auto --drafter mtp --max-new-tokens 256 --repeat 3 --no-hf \
          --out "$OUT/bench_demo_rope_${rope}.json" | grep -E "auto|mtp|none|rror")
  done
  ;;
rope62b)  # stop 62 (about 6 minutes): the 27B shape uncompiled (the chat's default: eager steps in CUDA graphs) with
  # the rope kernels and without
  for rope in triton torch; do
    [ $SECONDS -lt 400 ] && (export MTPCHAT_ROPE=$rope; BENCH_TIMEOUT=$((580 - SECONDS)) bench --random-weights qwen3.5-27b \
          --depths 0,3 --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf \
          --out "$OUT/bench27b_rope_${rope}.json" | grep -E "none|oracle|HBM|rror")
  done
  ;;
swiglu62)  # stop 62 (about 5 minutes): swiglu_triton's GPU tests; the demo model's plain and depth-3 rows with the
  # kernel and without (both with the rope kernels); where a depth-3 cycle's kernel time goes (profile_cycle.py);
  # whether probes from plain decoding accept as depth-1 cycles in a row do (probe_acceptance.py), as time allows
  gpu_tests ${TEST_LIMIT:-120} "$OUT/gpu_tests_swiglu62.log" tests/test_swiglu_triton.py
  for act in triton torch; do
    [ $SECONDS -lt 230 ] && (export MTPCHAT_SWIGLU=$act; BENCH_TIMEOUT=80 bench --model engine/assets/demo --depths 0,3 \
          --drafter mtp --max-new-tokens 256 --repeat 2 --no-hf --out "$OUT/bench_demo_swiglu_${act}.json" \
          | grep -E "mtp|none|rror")
  done
  [ $SECONDS -lt 260 ] && timeout 60 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
        --json "$OUT/cycle_demo_62.json" 2>&1 | grep -E "^depth|rror"
  [ $SECONDS -lt 270 ] && timeout 45 python3 packaging/bench/probe_acceptance.py --device cuda --dtype bfloat16 --every 1,17 \
        --graphs 1 --tokens 200 --json "$OUT/probe_acceptance_demo.json" 2>&1 | grep -E "^graphs|rror"
  ;;
stop63)  # stop 63 (about 7 minutes): the demo model's plain, depth 3-4 and auto rows with auto's climb going on from
  # a probe's depth; swiglu_triton's GPU tests; where a depth-3 cycle's kernel time goes (profile_cycle.py)
  BENCH_TIMEOUT=240 bench --model engine/assets/demo --depths 0,3,4,auto --drafter mtp --max-new-tokens 256 --repeat 3 \
        --no-hf --out "$OUT/bench_demo_climb63.json" | grep -E "auto|mtp|none|rror"
  gpu_tests ${TEST_LIMIT:-150} "$OUT/gpu_tests_swiglu63.log" tests/test_swiglu_triton.py tests/test_rope_triton.py \
        tests/test_conv_triton.py -k "swiglu or install"
  [ $SECONDS -lt 380 ] && timeout 60 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
        --json "$OUT/cycle_demo_63.json" 2>&1 | grep -E "^depth|rror"
  ;;
stop63b)  # stop 63 (about 3 minutes): the demo model after the one gather over Qwen3-Next's GDN projections (its plain,
  # depth-3 and auto rows, the cycle profile), then its graph tests (the four families, float32)
  BENCH_TIMEOUT=120 bench --model engine/assets/demo --depths 0,3,auto --drafter mtp --max-new-tokens 256 --repeat 2 \
        --no-hf --out "$OUT/bench_demo_gather63.json" | grep -E "auto|mtp|none|rror"
  timeout 60 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
        --json "$OUT/cycle_demo_gather63.json" 2>&1 | grep -E "^depth|rror"
  [ $SECONDS -lt 150 ] && gpu_tests $((170 - SECONDS)) "$OUT/gpu_tests_gather63.log" tests/test_gpu.py -k cuda_graphs_certified
  ;;
stop64)  # stop 64 (under 5 minutes): the demo model with its GDN projections in order at load (no gather), the
  # split-K attention with its merge kernel (chosen at every capacity where it timed faster at load), the short
  # conv's verify tokens in programs of their own and the row form among the four-row linears: the new kernels'
  # GPU tests first, then the choice, the plain / depth-3 / auto rows and, as time allows, the cycle profile
  gpu_tests 150 "$OUT/gpu_tests_stop64.log" tests/test_attention_triton.py tests/test_conv_triton.py \
        tests/test_linear16_triton.py tests/test_gpu.py -k "not compile or for_a_gpu"
  timeout 60 python3 -c "from engine import load_engine; e = load_engine('engine/assets/demo', device='cuda'); \
print(e.trunk.backends.choice['decode_attention'])" 2>&1 | tail -2 | tee "$OUT/attention_choice64.txt"
  [ $SECONDS -lt 200 ] && BENCH_TIMEOUT=$((280 - SECONDS)) bench --model engine/assets/demo --depths 0,3,auto \
        --drafter mtp --max-new-tokens 256 --repeat 2 --no-hf --out "$OUT/bench_demo_stop64.json" | grep -E "auto|mtp|none|rror"
  [ $SECONDS -lt 240 ] && timeout $((290 - SECONDS)) python3 packaging/bench/profile_cycle.py --model engine/assets/demo \
        --depths 0,3 --json "$OUT/cycle_demo_stop64.json" 2>&1 | grep -E "^depth|rror"
  ;;
stop65)  # stop 65 (under 5 minutes): the demo model with stops 64-65's kernels (the cycle graphs' acceptance and
  # commit in Triton kernels, cycle_triton; the split-K attention gating its output; rope writing keys and values
  # into the cache): their GPU tests first, then the choices, the plain / depth-3 / auto rows and, as time allows,
  # the cycle profile
  gpu_tests 120 "$OUT/gpu_tests_stop65.log" tests/test_cycle_triton.py tests/test_attention_triton.py \
        tests/test_rope_triton.py tests/test_conv_triton.py tests/test_linear16_triton.py -k "not engine and not graph_passes and not cycle_graphs"
  timeout 45 python3 -c "from engine import load_engine; e = load_engine('engine/assets/demo', device='cuda'); \
c = e.trunk.backends.choice; print(c['decode_attention']); print(c['cycle']); print(c['rope'])" 2>&1 | tail -3 | tee "$OUT/choice65.txt"
  [ $SECONDS -lt 180 ] && BENCH_TIMEOUT=$((270 - SECONDS)) bench --model engine/assets/demo --depths 0,3,auto \
        --drafter mtp --max-new-tokens 256 --repeat 2 --no-hf --out "$OUT/bench_demo_stop65.json" | grep -E "auto|mtp|none|rror"
  [ $SECONDS -lt 230 ] && timeout $((290 - SECONDS)) python3 packaging/bench/profile_cycle.py --model engine/assets/demo \
        --depths 0,3 --json "$OUT/cycle_demo_stop65.json" 2>&1 | grep -E "^depth|rror"
  ;;
stop66)  # stop 66 (under 10 minutes): q_norm / k_norm in rope's launch (its GPU tests); auto's plain picks held until the next probe could be due (autodepth.HOLD_MAX)
  # against reading the estimates every cycle, on the demo; then the H200's records (#23's 80B-A3B in FP8, #28's 27B
  # in bf16, both --compile) where this is an H200, else the demo's rows
  gpu_tests 100 "$OUT/gpu_tests_stop66.log" tests/test_rope_triton.py -k "qk_norms or store or rotation"
  timeout 170 python3 packaging/bench/auto_overhead.py 2>&1 | tail -2
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    BENCH_TIMEOUT=$((520 - SECONDS)) bench --random-weights qwen3-next-80b-a3b --quant fp8 --compile --depths 0,3 \
        --drafter oracle --acceptance 1.0 --max-new-tokens 48 --repeat 2 --no-hf --out "$OUT/bench80b_fp8_compile66_h200.json" \
        | grep -E "none|oracle|HBM|rror"
    [ $SECONDS -lt 380 ] && BENCH_TIMEOUT=$((540 - SECONDS)) bench --random-weights qwen3.5-27b --compile --depths 0,3 \
        --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_compile66_h200.json" \
        | grep -E "none|oracle|HBM|rror"
  else
    BENCH_TIMEOUT=$((400 - SECONDS)) bench --model engine/assets/demo --depths 0,1,2,3,auto --drafter mtp \
        --max-new-tokens 256 --repeat 3 --no-hf --out "$OUT/bench_demo_stop66.json" | grep -E "auto|mtp|none|rror"
  fi
  ;;
stop67)  # stop 67 (under 10 minutes): auto's probes from plain decoding capped at 128 cycles apart, not 64 (both in
  # auto_overhead.py, with auto's last reply traced), the demo's rows; then the H200's records (#23's 80B-A3B in FP8,
  # #28's 27B in bf16, both --compile) where this is an H200
  timeout 170 python3 packaging/bench/auto_overhead.py 2>&1 | tail -1 | cut -c1-600
  BENCH_TIMEOUT=120 bench --model engine/assets/demo --depths 0,3,auto --drafter mtp --max-new-tokens 256 --repeat 3 \
        --no-hf --out "$OUT/bench_demo_stop67.json" | grep -E "auto|mtp|none|rror"
  records67 540
  ;;
ab67)  # stop 67: auto_ab.py, 40 rounds of plain, depth 3, auto at PROBE_MAX 64 and at 128 (under 4 minutes); then
  # on an H200 the records (#23's 80B-A3B in FP8, #28's 27B in bf16, both --compile)
  timeout 200 python3 packaging/bench/auto_ab.py --rounds 40 2>&1 | tail -1 | cut -c1-900
  records67 560
  ;;
auto67)  # stop 67 (under 6 minutes): auto_ab.py (40 rounds), then auto_overhead.py (its profile now names who calls
  # eager linears and custom ops inside a reply)
  timeout 150 python3 packaging/bench/auto_ab.py --rounds 40 2>&1 | tail -1 | cut -c1-900
  timeout 200 python3 packaging/bench/auto_overhead.py 2>&1 | tail -1 | cut -c1-300
  ;;
switch67)  # stop 67 (under 7 minutes): a switch from plain decoding and a reply's first cycle launch a cycle graph
  # after the head's catch-up: the CUDA graph tests that count its graphs, then auto_ab.py. (Stop 67 gave them 90
  # and 85 s: on a fresh H100 the Triton kernels' first compilation took all of it, and neither finished.)
  gpu_tests 240 "$OUT/gpu_tests_switch67.log" tests/test_gpu.py::test_cuda_graphs_certified_and_lossless \
        tests/test_host_embedding.py::test_host_table_exact_in_graphs_and_off_the_gpu
  timeout 150 python3 packaging/bench/auto_ab.py --rounds 40 2>&1 | tail -1 | cut -c1-900
  BENCH_TIMEOUT=90 bench --model engine/assets/demo --depths 0,3 --drafter mtp --max-new-tokens 256 --repeat 3 \
        --no-hf --out "$OUT/bench_demo_switch67.json" | grep -E "auto|mtp|none|rror"
  ;;
gdn68)  # stop 68 (under 10 minutes): our GDN recurrence for a few tokens (gdn_triton.py) and the stream form's tiles
  # for a few rows (fp8_triton._fp8_stream_rows): the choices on the demo, the demo's rows with our recurrence and
  # without (MTPCHAT_GDN_RECURRENT=torch: FLA's launch) in turns, the demo's cycle profile, then their GPU tests
  timeout 90 python3 -c "from engine import load_engine, gdn_triton, linear16_triton as l; e = load_engine('engine/assets/demo', \
device='cuda'); print(e.trunk.backends.choice['gdn_recurrent'], gdn_triton._chosen, l._chosen)" 2>&1 | tail -2 \
      | tee "$OUT/gdn_choice68.txt"
  for arm in ours fla ours; do
    ([ $arm = fla ] && export MTPCHAT_GDN_RECURRENT=torch; BENCH_TIMEOUT=75 bench --model engine/assets/demo --depths 0,3 \
        --drafter mtp --max-new-tokens 256 --repeat 3 --no-hf --out "$OUT/bench_demo_gdn68_${arm}_$SECONDS.json" \
        | grep -E "mtp|none|rror" | sed "s/^/$arm /")
  done
  timeout 100 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
      --json "$OUT/cycle_demo_gdn68.json" 2>&1 | grep depth
  gpu_tests $((590 - SECONDS)) "$OUT/gpu_tests_gdn68.log" tests/test_gdn_triton.py tests/test_linear16_triton.py \
      tests/test_fp8_triton.py
  ;;
demo68)  # stop 68 (under 7 minutes): the demo model's rows at depths 0-4 and auto after gdn_triton and streamrows,
  # then auto_ab.py's alternating rounds as time allows
  BENCH_TIMEOUT=230 bench --model engine/assets/demo --depths 0,1,2,3,4,auto --drafter mtp --max-new-tokens 256 \
      --repeat 3 --no-hf --out "$OUT/bench_demo_stop68.json" | grep -E "auto|mtp|none|rror"
  timeout $((380 - SECONDS)) python3 packaging/bench/auto_ab.py --rounds 24 2>&1 | tail -1 | cut -c1-900
  ;;
stop69)  # stop 69 (under 10 minutes): the demo model's rows at depths 0-4 and auto (auto falls to plain decoding only
  # where it is faster at the acceptance estimates plus FALL_DOUBT spreads), then auto_ab.py's alternating rounds,
  # auto without that doubt (A) and with it (B)
  BENCH_TIMEOUT=230 bench --model engine/assets/demo --depths 0,1,2,3,4,auto --drafter mtp --max-new-tokens 256 \
      --repeat 3 --no-hf --out "$OUT/bench_demo_stop69.json" | grep -E "auto|mtp|none|rror"
  timeout $((585 - SECONDS)) python3 packaging/bench/auto_ab.py --rounds 40 --a FALL_DOUBT=0 --b FALL_DOUBT=2 \
      2>&1 | tail -1 | cut -c1-1200
  ;;
demo69)  # stop 69 (under 5 minutes on a warm machine): stop69's rows and rounds, fewer, then reply_overhead.py (plain
  # and depth 3 with the turn's reuse on and off)
  BENCH_TIMEOUT=150 bench --model engine/assets/demo --depths 0,1,2,3,4,auto --drafter mtp --max-new-tokens 256 \
      --repeat 3 --no-hf --out "$OUT/bench_demo_demo69.json" | grep -E "auto|mtp|none|rror"
  timeout 100 python3 packaging/bench/auto_ab.py --rounds 20 --a FALL_DOUBT=0 --b FALL_DOUBT=2 2>&1 | tail -1 \
      | cut -c1-1200
  timeout $((330 - SECONDS)) python3 packaging/bench/reply_overhead.py --rounds 6 2>&1 | tail -1
  ;;
cycle69)  # stop 69 (under 6 minutes): a cycle graph's tokens in one row (no concatenations), positions from a kept
  # arange (one launch, not two), a greedy verify pass's logits left in 16 bits (argmax alone reads them): the GPU
  # tests of graphs and cycles, the demo's rows at depths 0 and 3, then the cycle profile
  gpu_tests 100 "$OUT/gpu_tests_cycle69.log" tests/test_gpu.py::test_cuda_graphs_certified_and_lossless \
        tests/test_cycle_triton.py tests/test_host_embedding.py::test_host_table_exact_in_graphs_and_off_the_gpu
  BENCH_TIMEOUT=60 bench --model engine/assets/demo --depths 0,3 --drafter mtp --max-new-tokens 256 \
      --repeat 2 --no-hf --out "$OUT/bench_demo_cycle69.json" | grep -E "auto|mtp|none|rror"
  timeout $((290 - SECONDS)) python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
      --json "$OUT/cycle_demo_cycle69.json" 2>&1 | grep depth
  ;;
demo71)  # stops 69-71 (under 5 minutes): the cycle graphs (stops 69, 70) and the kernels since (the argmax, the wide
  # row tiles, the decode attention merged in its last split program) through their GPU tests, the demo's rows at
  # depths 0, 3 and auto, its kernel choices, the cycle profile, then as time allows every 16-bit kernel form at the
  # demo's shapes at 4 rows
  gpu_tests 100 "$OUT/gpu_tests_demo71.log" tests/test_gpu.py::test_cuda_graphs_certified_and_lossless \
        tests/test_cycle_triton.py tests/test_host_embedding.py::test_host_table_exact_in_graphs_and_off_the_gpu \
        tests/test_linear16_triton.py tests/test_attention_triton.py
  BENCH_TIMEOUT=80 bench --model engine/assets/demo --depths 0,3,auto --drafter mtp --max-new-tokens 256 \
      --repeat 3 --no-hf --out "$OUT/bench_demo_demo71.json" | grep -E "auto|mtp|none|rror"
  timeout 45 python3 -c "from engine import load_engine, linear16_triton as l; e = load_engine('engine/assets/demo', \
device='cuda'); c = e.trunk.backends.choice; print(c.get('argmax'), c.get('decode_attention'), l._chosen)" 2>&1 \
      | tail -1 | tee "$OUT/choice71.txt"
  timeout 60 python3 packaging/bench/profile_cycle.py --model engine/assets/demo --depths 0,3 \
      --json "$OUT/cycle_demo_demo71.json" 2>&1 | grep depth
  timeout $((340 - SECONDS)) python3 packaging/bench/quant_kernels.py --quant bf16 --shapes demo --rows 4 \
      --json "$OUT/quant_kernels_bf16_demo71.json" > "$OUT/quant_kernels_bf16_demo71.txt" 2>&1
  grep "rows [14]:" "$OUT/quant_kernels_bf16_demo71.txt"
  ;;
stop71)  # stop 71 (under 10 minutes): on an H200, the new kernels' GPU tests (the decode attention merged in its
  # last split program, the argmax in the acceptance's launch), then the records (#23's whole 80B-A3B in FP8, #28's
  # 27B shape in bf16, both --compile); on any other GPU demo71
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    gpu_tests 70 "$OUT/gpu_tests_stop71.log" tests/test_attention_triton.py tests/test_cycle_triton.py
    records67 470
  else
    bash "$0" demo71
  fi
  ;;
records68)  # stop 68 (needs an H200, under 10 minutes): the records alone, first in the call (#23's whole 80B-A3B in
  # FP8, then #28's 27B shape in bf16, both --compile, plain and depth 3 at acceptance 1.0)
  records67 520
  ;;
stop66b)  # stop 66 in under 5 minutes: rope's GPU tests (q_norm / k_norm in its launch), then auto_overhead.py
  gpu_tests 90 "$OUT/gpu_tests_stop66.log" tests/test_rope_triton.py -k "qk_norms or store or rotation"
  timeout 170 python3 packaging/bench/auto_overhead.py 2>&1 | tail -2
  ;;
auto65)  # stop 65's question (under 3 minutes): where --depth auto's plain cycles lose 8% to plain decoding on the
  # demo model (the chooser's host time or the drafter's keep of each step's hidden)
  timeout 170 python3 packaging/bench/auto_overhead.py 2>&1 | tail -3
  ;;
stop64t)  # stop 64's short check (under 3 minutes): the new kernels' GPU tests and the demo's attention choice
  gpu_tests 110 "$OUT/gpu_tests_stop64t.log" tests/test_attention_triton.py tests/test_conv_triton.py \
        tests/test_linear16_triton.py
  timeout 50 python3 -c "from engine import load_engine; e = load_engine('engine/assets/demo', device='cuda'); \
print(e.trunk.backends.choice['decode_attention'])" 2>&1 | tail -2 | tee "$OUT/attention_choice64.txt"
  ;;
fp8x62)  # stop 62 (needs an H200: 80 GB of FP8 weights): #23's whole 80B-A3B in FP8, compiled, as its record
  # (299.4 tok/s); then, as time allows, #28's 27B shape in bf16, compiled, plain and depth 3
  BENCH_TIMEOUT=400 bench --random-weights qwen3-next-80b-a3b --quant fp8 --compile --depths 0,3 --drafter oracle \
        --acceptance 1.0 --max-new-tokens 48 --repeat 2 --no-hf --out "$OUT/bench80b_fp8_compile62_h200.json" \
        | grep -E "none|oracle|HBM|rror"
  [ $SECONDS -lt 420 ] && BENCH_TIMEOUT=$((580 - SECONDS)) bench --random-weights qwen3.5-27b --compile --depths 0,3 \
        --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf --out "$OUT/bench27b_compile62_h200.json" \
        | grep -E "none|oracle|HBM|rror"
  ;;
conv60)  # stop 60 (under 10 minutes): each bench with the short conv and the residual adds
  # with their norms as one kernel each (triton) and as torch ops (torch: MTPCHAT_SHORT_CONV=torch MTPCHAT_ADD_NORM=0),
  # in one call: the demo model (auto rows included) and the 27B shape uncompiled (the chat's default; --compile
  # traces the torch forms)
  # (the kernels' GPU tests: conv61, in a call of their own since stop 61; a fresh machine compiles each width's
  # kernel in the first arm's load, so the demo arms have 200 s)
  arm() { [ $1 = torch ] && echo "MTPCHAT_ADD_NORM=0 MTPCHAT_SHORT_CONV=torch" || echo "MTPCHAT_ADD_NORM=1"; }
  for conv in triton torch; do
    (export $(arm $conv); BENCH_TIMEOUT=200 bench --model engine/assets/demo --depths 0,2,3,4,auto --drafter mtp \
          --max-new-tokens 256 --repeat 3 --no-hf --out "$OUT/bench_demo_conv_${conv}.json" | grep -E "auto|mtp|none|rror")
  done
  for conv in triton torch; do
    [ $SECONDS -lt 480 ] && (export $(arm $conv); BENCH_TIMEOUT=$((590 - SECONDS)) bench --random-weights qwen3.5-27b \
          --depths 0,3 --drafter oracle --acceptance 1.0 --max-new-tokens 64 --repeat 2 --no-hf \
          --out "$OUT/bench27b_conv_${conv}.json" | grep -E "none|oracle|HBM|rror")
  done
  ;;
esac
