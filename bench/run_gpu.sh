#!/usr/bin/env bash
# One GPU session's measurements: install the carried wheels (made here by bench/prep_wheels.sh;
# carry .whl), then run the named part(s) with a time bound each. Results land in $OUT (or ./gpu-out).
# Usage on the GPU machine: bash bench/run_gpu.sh parity roofline serve-mux | throughput serve
# (hybrid and MoE parts: roofline-next, throughput-next, prefix-next, roofline-moe, throughput-moe)
# (serving parts: serve, serve-mux, serve-scale, serve-scale-stream, serve-alt)
# (FP8 parts: fp8-next, fp8-llama)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
# The carried wheels, then each distribution's source root (namespace package `tandem`, PEP 420).
export PYTHONPATH=/tmp/site:$PWD/protos:$PWD/common:$PWD/frontend:$PWD/kernels:$PWD/engine_service:$PWD/tools
python3 -c "import msgspec, zmq, structlog, llguidance, opentelemetry.sdk" || { echo "a wheel is missing from .whl: run bench/prep_wheels.sh on the dev machine"; exit 1; }
[ -f .whl/COMMIT ] && export TANDEM_GIT_COMMIT=$(cat .whl/COMMIT)
PY="python3 -P"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
for part in "$@"; do
  echo "=== $part ($(date -u +%T))"
  case "$part" in
    kernels) timeout 200 $PY -m tandem.gpu_checks.kernel_check --out "$OUT" ;;
    parity) timeout 200 $PY -m tandem.gpu_checks.model_parity --out "$OUT" ;;
    # Windowed layers (two paged cache groups): reference vs Triton eager vs Triton graphs.
    parity-sw) timeout 200 $PY -m tandem.gpu_checks.model_parity --model dummy:qwen3-0.6b-sw64 --out "$OUT/parity-sw" ;;
    roofline) timeout 200 $PY -m tandem.cli bench roofline --model dummy:qwen3-8b --max-model-len 8192 --max-seconds 180 --out "$OUT" ;;
    # Acceptance 8: every layer on a 1k window; the floor counts only the window's K/V.
    roofline-sw) timeout 200 $PY -m tandem.cli bench roofline --model dummy:qwen3-8b-sw1k --max-model-len 8192 --contexts 8192 --batches 1,16,64,256 --max-seconds 180 --out "$OUT" ;;
    roofline-llama) timeout 200 $PY -m tandem.cli bench roofline --model dummy:llama-3.1-8b --max-model-len 8192 --max-seconds 180 --out "$OUT" ;;
    throughput) timeout 200 $PY -m tandem.cli bench throughput --model dummy:qwen3-0.6b --workload nanovllm --peer-num-prompts 64 --max-seconds 185 --out "$OUT" ;;
    # 1000 x 1024/1024: the engine may take 70 % of the time left, the 8-request peer the rest.
    random-1k) timeout 580 $PY -m tandem.cli bench throughput --model dummy:qwen3-0.6b --workload random-1k --peer-num-prompts 8 --engine-share 0.7 --max-seconds 560 --out "$OUT" ;;
    # Hybrid (Issue #11 acceptance 4): Qwen3-Next layer shapes, 12 layers (9 GDN + 3 gated attention,
    # MoE everywhere). Floor = active experts' weights + K/V of the attention layers + state slots
    # read and written back; prefill MFU at the default shapes (8x1024, 1x8192).
    roofline-next) timeout 225 $PY -m tandem.cli bench roofline --model dummy:qwen3-next-80b-a3b --max-model-len 8192 --batches 1,64,256 --contexts 1024,8192 --max-seconds 200 --out "$OUT" ;;
    # The same model against the HF peer on a 16-request subset: transformers' continuous batching
    # cannot serve linear_attention layers, so the peer runs one static left-padded generate batch
    # (peer.mode / peer.mode_reason / peer.linear_attention_kernels in the JSON say so). Lengths at
    # 0.25 of nanovllm's (25-256 in and out): transformers' torch fallbacks of the GDN kernels and its
    # per-expert loop took > 34 s for 8 requests of up to 726 tokens at 581fbbd. The peer is checked
    # layer by layer, teacher-forced (tandem/bench/peer_check.py: top-10 routing of random experts
    # cannot be checked end to end in bfloat16).
    throughput-next) timeout 300 $PY -m tandem.cli bench throughput --model dummy:qwen3-next-80b-a3b --max-model-len 4096 --workload nanovllm --scale 0.25 --num-prompts 128 --peer-num-prompts 16 --peer-static-batch-size 16 --max-seconds 280 --out "$OUT" ;;
    # Qwen3-30B-A3B layer shapes (48 layers, 128 experts, top-8): floor = active experts' weights + K/V.
    roofline-moe) timeout 170 $PY -m tandem.cli bench roofline --model dummy:qwen3-30b-a3b --max-model-len 8192 --batches 1,64,256 --contexts 1024,8192 --max-seconds 150 --out "$OUT" ;;
    # Qwen3-30B-A3B against transformers' continuous batching (full attention: CB serves it) on a 32-request subset.
    throughput-moe) timeout 270 $PY -m tandem.cli bench throughput --model dummy:qwen3-30b-a3b --max-model-len 4096 --workload nanovllm --scale 0.25 --num-prompts 256 --peer-num-prompts 32 --max-seconds 250 --out "$OUT" ;;
    # Prefix-cache hit rates of a hybrid (state checkpoints) against its all-full-attention twin, and
    # the no-reuse cost of keeping checkpoints.
    prefix-next) timeout 450 $PY -m tandem.cli bench prefix --model dummy:qwen3.5-9b --max-model-len 8192 --max-seconds 420 --out "$OUT" ;;
    # Issue 26: one decode step at batch 1 (1k context, the served bucket-1 CUDA graph, which does not
    # depend on the larger buckets: 8 are captured, not 256, to save start-up; roofline's max_model_len)
    # kernel by kernel and layer by layer, and one eager 1k-token prefill step of Qwen3-0.6B.
    profile)
      for m in qwen3-8b qwen3-30b-a3b qwen3-next-80b-a3b; do
        timeout 150 $PY -m tandem.cli bench profile --model dummy:$m --max-model-len 8192 --max-num-seqs 8 --max-seconds 140 --out "$OUT"
      done
      timeout 120 $PY -m tandem.cli bench profile --model dummy:qwen3-0.6b --max-model-len 8192 --max-num-seqs 8 --decode-shapes none \
        --prefill-shapes 1x1024 --max-seconds 110 --out "$OUT" ;;
    # Issue 26 acceptance 3: the whole Qwen3-Next-80B-A3B (48 layers) with FP8 dummy weights on one H200:
    # ~75 GiB of weights and scales (148 GiB in bf16 would not fit; the model is built on meta and
    # allocated as FP8). Decode at batch 1 and 64 against the FP8 floor (projections and experts at
    # 1 + 4/128^2 bytes a weight), one 8x1024 prefill; CUDA graphs up to batch 64 only, to save start-up.
    fp8-next) timeout 300 $PY -m tandem.cli bench roofline --model dummy:qwen3-next-80b-a3b-l48 --quantization fp8 --max-model-len 4096 --max-num-seqs 64 --batches 1,64 --contexts 1024 --prefill-shapes 8x1024 --max-seconds 280 --out "$OUT" ;;
    # Issue 26 acceptance 3: Llama-3.1-8B quantized to FP8 on load, 1000 random requests of exactly
    # 1000 in / 1000 out (random-1k's 1024 x 0.9765625), the workload TensorRT-LLM publishes 17,744
    # output tok/s for on one H200. Engine only: the HF peer copies the engine's tensors into a bf16
    # transformers model, which cannot take FP8 weights and their scales.
    fp8-llama) timeout 240 $PY -m tandem.cli bench throughput --model dummy:llama-3.1-8b --quantization fp8 --max-model-len 4096 --workload random-1k --scale 0.9765625 --no-peer --max-seconds 220 --out "$OUT" ;;
    # Issue 18: Sampler.sample with the filter kernel on and off (tokens, then times) at vocab 151936.
    sampler) timeout 200 $PY bench/probes/sampler_probe.py --batches 1,64,256 ;;
    # Issue 30 item 4 (issue 21 acceptance 2): the unconstrained decode step unchanged by structured
    # output. The probe (unseeded: the batched sampler path) on the tree before structured output
    # and on this one, A B A B. Needs that tree beside this one: `git archive 3b4ed1f protos common
    # frontend kernels engine_service tools | tar -x -C .base` on the dev machine (carry .base).
    so-aba)
      [ -d .base/engine_service ] || { echo "so-aba needs .base (the tree at 3b4ed1f)"; continue; }
      for round in 1 2; do for side in base head; do
        root=$PWD; [ $side = base ] && root=$PWD/.base
        mkdir -p "$OUT/so-aba/$side-$round"
        OUT="$OUT/so-aba/$side-$round" PYTHONPATH=/tmp/site:$root/protos:$root/common:$root/frontend:$root/kernels:$root/engine_service:$root/tools \
          timeout 100 $PY bench/probes/structured_output_probe.py dummy:qwen3-0.6b --modes unconstrained --batches 1,64,256 | sed "s/^/$side-$round /"
      done; done ;;
    # Structured output's own cost: all constrained and half constrained against unconstrained.
    # Dummy weights get a word-level tokenizer here (no embedded model), which llguidance cannot
    # read: carry .tok/tokenizer.json (the embedded SmolLM2's, from the dev machine's cache).
    so-modes) timeout 150 $PY bench/probes/structured_output_probe.py dummy:qwen3-0.6b --batches 1,64,256 --tokenizer .tok/tokenizer.json ;;
    # Host time per step with a model-free runner, against the Qwen3-8B batch-256 step (roofline).
    overhead) timeout 120 $PY -m tandem.cli bench overhead --batches 64,256 --gpu-step-ms "${GPU_STEP_MS:-16.4}" --out "$OUT" ;;
    # Issue 11: the hybrid models against transformers' own classes (reference vs Triton eager vs graphs), in parallel.
    parity-hybrid)
      for m in tiny-qwen3.5 tiny-qwen3-next tiny-qwen3.5-moe; do
        timeout 280 $PY -m tandem.gpu_checks.model_parity --model dummy:$m --out "$OUT/parity-$m" >"$OUT/parity-$m.log" 2>&1 &
      done; wait; tail -n 12 "$OUT"/parity-*.log ;;
    kernels-gdn) timeout 200 $PY -m tandem.gpu_checks.kernel_check --only gdn --out "$OUT/kernels-gdn" ;;
    # Issue 12: pulls between two processes on the GPU (GB/s vs device copies), then two engines' greedy tokens.
    kvxfer) timeout 240 $PY -m tandem.gpu_checks.kv_transfer --out "$OUT/kvxfer" ;;
    # Issue 12: one engine vs prefill + decode engines (Qwen3-8B, CUDA IPC) under long prompts during decode traffic.
    disagg) timeout 330 $PY -m tandem.cli bench disagg --model dummy:qwen3-8b --num-kv-blocks 8192 --kv-transport cuda_ipc --mixed-seconds ${DISAGG_SECONDS:-75} --max-seconds 310 --out "$OUT" ;;
    # Issue 26 item 5: steps with prefill rows through piecewise CUDA graphs. Prefill steps of
    # Qwen3-0.6B timed as served (pieces) and eagerly, then TTFT at concurrency 1 (64 requests of
    # the nanovllm workload, in-process and served) and 16 (step-time spread of a mixed load).
    ttft)
      timeout 100 $PY -m tandem.cli bench profile --model dummy:qwen3-0.6b --max-model-len 8192 --max-num-seqs 8 --decode-shapes none \
        --prefill-shapes 1x128,1x512,1x1024,4x512 --max-seconds 90 --out "$OUT"
      timeout 230 $PY -m tandem.cli bench serve --model dummy:qwen3-0.6b --concurrency 1,16 --requests-per-level 64 --level-seconds 85 --max-seconds 220 --out "$OUT" ;;
    serve) timeout 230 $PY -m tandem.cli bench serve --model dummy:qwen3-0.6b --max-seconds 200 --out "$OUT" ;;
    serve-mux) timeout 230 $PY -m tandem.cli bench serve --model dummy:qwen3-0.6b --engine-transport mux --max-seconds 200 --out "$OUT" ;;
    # Four frontend processes on the port and four load-generator processes (see docs/operations.md).
    serve-scale) timeout 225 $PY -m tandem.cli bench serve --model dummy:qwen3-0.6b --engine-transport mux --frontend-workers 4 --client-procs 4 --max-seconds 200 --out "$OUT" ;;
    # serve-scale's stack, served and in-process alive together and alternating over 3 rounds of
    # fresh requests (medians; bench/NOTES.md). A round at 768 requests per level took ~136 s at
    # 071145Z (c64 45 + 40 s, c256 26 + 25 s) after ~40 s of start-up and warm-up: 3 rounds fit
    # --max-seconds 500 with ~12 % to spare per round, and the part ends within 535 s. 24576 KV
    # blocks each (42 GiB for qwen3-0.6b; c256 needs ~16k) leave both engines room on one H200.
    serve-alt) timeout 535 $PY -m tandem.cli bench serve --model dummy:qwen3-0.6b --engine-transport mux --frontend-workers 4 --client-procs 4 --concurrency 64,256 --requests-per-level 768 --rounds 3 --num-kv-blocks 24576 --level-seconds 90 --max-seconds 500 --out "$OUT" ;;
    serve-scale-stream) timeout 230 $PY -m tandem.cli bench serve --model dummy:qwen3-0.6b --engine-transport stream --frontend-workers 4 --client-procs 4 --max-seconds 200 --out "$OUT" ;;
  esac
  echo "=== $part exit $?"
done 2>&1 | tee -a "$OUT/run.log"
