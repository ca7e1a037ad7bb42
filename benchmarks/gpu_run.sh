#!/bin/bash
# The whole measurement in one command, each stage under its own limit, <= 9 minutes: make gpu-report
# (benchmarks/gpu_report.py). This script keeps single stages at hand for a session that wants one of them.
# One batched GPU session (see benchmarks/README or the gpu helper's report): env check, GPU tests, every benchmark.
# Usage on the device machine, from the repo root: bash benchmarks/gpu_run.sh OUTDIR [STAGES...]
# A 30-minute lease, in order of what nothing else can measure: env suite (the CUDA tests, ~10 min) | attention
# decode | fp8block grouped lora | nbs | train. Each stage writes OUTDIR/<stage>.log; results land in res/.
OUTDIR=${1:-/tmp/out}; shift
STAGES=${*:-"env tests fp8 train norms softmax ce swiglu rope"}
mkdir -p "$OUTDIR/res"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
run() { local name=$1 t=$2; shift 2; echo "=== $name: $*"; timeout "$t" "$@" 2>&1 | tee "$OUTDIR/$name.log" | tail -n 60; echo "=== $name rc=${PIPESTATUS[0]}"; }
for s in $STAGES; do case $s in
  env) run env 60 python -c "import torch, triton, nbval, ipykernel, liger_kernel, jupytext, minite; print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), minite.__file__)";;
  tests) run tests 120 python -m pytest -p no:cacheprovider -q tests/kernels/test_compile.py tests/formats/test_fp8.py tests/layers/test_linear.py tests/kernels/test_rmsnorm.py tests/kernels/test_softmax.py;;
  tcompile) run tcompile 60 python -m pytest -p no:cacheprovider -q tests/kernels/test_compile.py tests/formats/test_fp8.py tests/layers/test_linear.py -k "compile or opcheck or fullgraph or gpu or cuda";;
  probe) run probe 40 python benchmarks/probe_overhead.py;;
  fp8sweep) SWEEP_FROM=5 run fp8 90 python benchmarks/bench_fp8_gemm.py --sweep --sizes 8192 --error-ks 4096 8192 --out "$OUTDIR/res/fp8_gemm.json";;
  normsweep) run normsweep 75 python benchmarks/bench_rmsnorm.py --sweep --ops layernorm --cols 1024 16384;;
  fp8) run fp8 120 python benchmarks/bench_fp8_gemm.py --sweep --out "$OUTDIR/res/fp8_gemm.json";;
  train) STEP_CASES=${STEP_CASES:-0,2,3,5} run train 150 python benchmarks/bench_train.py --steps 40 --no-train;;
  trainrun) run trainrun 120 python benchmarks/bench_train.py --target 1.6 --train.max_iters=250 --train.eval_iters=20 --out "$OUTDIR/res/train.json";;
  norms) run norms 120 python benchmarks/bench_rmsnorm.py --cols ${NORM_COLS:-1024 4096 16384} --out "$OUTDIR/res/rmsnorm.json";;
  softmax) run softmax 60 python benchmarks/bench_softmax.py --cols 1024 4096 16384 --out "$OUTDIR/res/softmax.json";;
  ce) run ce 60 python benchmarks/bench_cross_entropy.py;;
  swiglu) run swiglu 45 python benchmarks/bench_swiglu.py;;
  attention) run attention 150 python benchmarks/bench_attention.py --dims 64 128 --seqlens 1024 4096 16384;;
  decode) run decode 90 python benchmarks/bench_attention.py --decode;;
  lora) run lora 60 python benchmarks/bench_lora.py;;
  fp8block) run fp8block 120 python benchmarks/bench_fp8_block.py --sizes 4096 8192 --out "$OUTDIR/res/fp8_block.json";;
  grouped) run grouped 90 python benchmarks/bench_grouped_gemm.py;;
  moe) run moe 300 python -m pytest -p no:cacheprovider -q tests/kernels/test_grouped_gemm.py tests/layers/test_moe.py tests/models/test_decoding.py tests/kernels/test_fp8_block.py;;  # the ops, compiled MoE and CUDA-graph decoding of 2026-11-28
  suite) run suite 560 python -m pytest -p no:cacheprovider -q -m "not distributed" tests/kernels tests/formats tests/layers tests/models tests/test_train.py tests/test_fp8_recipes.py tests/test_hardening.py;;
  nbs) run nbs 300 python tools/nbtool.py execute notebooks/07_flash_attention.py notebooks/08_kv_cache.py notebooks/09_lora.py notebooks/15_fp8_at_scale.py notebooks/16_moe.py;;
  rope) run rope 60 python benchmarks/bench_rope.py --head-dims 64 128 --out "$OUTDIR/res/rope.json";;
esac; done
cp benchmarks/results/*nvidia* "$OUTDIR/res/" 2>/dev/null
tar czf "$OUTDIR/results.tgz" -C "$OUTDIR" res $(cd "$OUTDIR" && ls *.log) && rm -rf "$OUTDIR/res"
ls -la "$OUTDIR"
