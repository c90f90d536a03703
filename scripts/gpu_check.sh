#!/usr/bin/env bash
# Usage: scripts/gpu_check.sh [tests] [cast] [linear] [norm] [act] [mlp] [attn] [rope] [adam] [block]
#        [graphs] [cp] [cpprof] [cpacc] [cpscale] [gs] [demo] [demo:ARG+ARG] [prof] [flash] [model] [moe] [moe:ARG+ARG] [blockscale]
#        [tests:EXPR]
#        [block:REGEX] [model:V1,V2] [modelprof:V] [mtests] [tp] [tp:ARG+ARG] [fsdp] [fsdp:ARG+ARG] [flash:ARG+ARG]
#        [ncu] [ncu:ARG+ARG] [pack]
# The GPU test tier and the benchmarks in one call on a CUDA machine, logs and result JSON under
# $OUT (default ./out). No stage named: tests cast linear norm act mlp attn rope adam block.
# tests:EXPR runs the gpu tier with pytest -k EXPR (+ for a space: tests:fp8_attention+or+scaling); block:REGEX the block bench's variants
# matching REGEX (bench_block.py --only); model:V1,V2 bench_model.py --only V1 V2 (each with its
# baseline, a compiled variant with its eager self; model:V1,V2+--rounds+3 adds --rounds 3); modelprof:V bench_model.py --profile V. Multi-GPU stages use the GPUs that
# CUDA_VISIBLE_DEVICES leaves visible: mtests (the multigpu test tier), tp (bench_tp on 2 GPUs;
# tp:--profile adds its kernels and host cProfile, tp:--trace also Chrome traces in $OUT),
# fsdp (bench_fsdp on all visible GPUs; fsdp:--batch+2+--variants+bf16,tritium-fp8-ag passes those
# arguments: + for a space). ncu: Nsight Compute (clocks left alone) on the Hopper Gluon attention
# kernels, each launched once per case (bench_flash_attention.py --kernels --once; ncu:--cp adds
# one cp=2 rank's blocks): pipe utilization, issue and stall figures, the report in
# $OUT/ncu_flash.log (docs/attention.md, "What it took"). pack (last): everything under $OUT
# into $OUT/out.tgz, the JSON results also copied beside it (a caller that fetches a few files
# gets them all; JSON files of the same name in two folders: the tarball keeps both).
#        scripts/gpu_check.sh parallel 'GPUS:STAGE ...' ['GPUS:STAGE ...' ...]
# Several of the above side by side, each on its own GPUs (CUDA_VISIBLE_DEVICES=GPUS), its
# stages in order, its logs and results in $OUT/g<GPUS>/ (commas become dashes), e.g.
#   scripts/gpu_check.sh parallel '0:tests:attention graphs' '1:model:tritium_fp8_delayed' \
#     '2,3:CUDA_DEVICE_MAX_CONNECTIONS=1 tp'       (VAR=value words: that job's environment)
# then each job's log tail, and everything under $OUT packed into $OUT/out.tgz. Jobs beside
# each other share the host's CPUs: compare timings within one job, or rerun a baseline alone.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"; export OUT
export PYTHONPATH=$PWD
# a copy of the tree whose .git is not current names its commit in .git_head (written by the
# caller after committing): the results record it (benchmarks/harness.py, BENCH_COMMIT)
if [ -z "${BENCH_COMMIT:-}" ] && [ -f .git_head ]; then export BENCH_COMMIT=$(cat .git_head); fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then   # once per machine (parallel calls share it)
  [ -d /tmp/peers/torchao ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/peers .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/peers
fi
if [ "${1:-}" = parallel ]; then
  shift
  for job in "$@"; do
    gpus=${job%%:*}; dir="$OUT/g${gpus//,/-}"; mkdir -p "$dir"; envs=(); args=()
    for word in ${job#*:}; do
      if [[ $word == *=* && $word != *:* ]]; then envs+=("$word"); else args+=("$word"); fi
    done
    CUDA_VISIBLE_DEVICES=$gpus OUT=$dir env "${envs[@]}" "$0" "${args[@]}" > "$dir/job.log" 2>&1 &
  done
  wait
  for log in "$OUT"/g*/job.log; do echo "=== ${log#"$OUT"/}"; tail -15 "$log"; done
  t=$(mktemp -d); (cd "$OUT" && tar czf "$t/out.tgz" . && rm -rf ./* && mv "$t/out.tgz" .)
  ls -la "$OUT"; exit 0
fi
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
stages=${*:-tests cast linear norm act mlp attn rope adam block}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
for s in $stages; do
  case $s in
    tests)  python3 -m pytest -q --continue-on-collection-errors -m "gpu or multigpu" tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    cast)   python3 benchmarks/bench_cast.py 2>&1 | tee "$OUT/bench_cast.log" | grep -v "^{" ;;
    linear) python3 benchmarks/bench_linear.py 2>&1 | tee "$OUT/bench_linear.log" | grep -v "^{" ;;
    norm)   python3 benchmarks/bench_norm.py 2>&1 | tee "$OUT/bench_norm.log" | grep -v "^{" ;;
    act)    python3 benchmarks/bench_activation.py 2>&1 | tee "$OUT/bench_act.log" | grep -v "^{" ;;
    mlp)    python3 benchmarks/bench_mlp.py 2>&1 | tee "$OUT/bench_mlp.log" | grep -v "^{" ;;
    attn)   python3 benchmarks/bench_attention.py 2>&1 | tee "$OUT/bench_attn.log" | grep -v "^{" ;;
    rope)   python3 benchmarks/bench_rope.py 2>&1 | tee "$OUT/bench_rope.log" | grep -v "^{" ;;
    adam)   python3 benchmarks/bench_adam.py 2>&1 | tee "$OUT/bench_adam.log" | grep -v "^{" ;;
    prof)   python3 scripts/profile_host.py ops 2>&1 | tee "$OUT/profile_ops.log" ;;
    graphs) python3 benchmarks/bench_graphs.py 2>&1 | tee "$OUT/bench_graphs.log" | grep -v "^{" ;;
    cp)     python3 benchmarks/bench_cp.py 2>&1 | tee "$OUT/bench_cp.log" | grep -v "^{" ;;
    cpprof) python3 benchmarks/bench_cp.py --profile 2>&1 | tee "$OUT/bench_cp_profile.log" | tail -80 ;;
    flash)  python3 benchmarks/bench_flash_attention.py 2>&1 | tee "$OUT/bench_flash.log" | grep -v "^{" ;;
    flash:*) a=${s#flash:}; python3 benchmarks/bench_flash_attention.py ${a//+/ } 2>&1 | tee "$OUT/bench_flash.log" | grep -v "^{" ;;
    cpscale) torchrun --nproc_per_node="$(nvidia-smi -L | wc -l)" benchmarks/bench_cp_scale.py 2>&1 | tee "$OUT/bench_cp_scale.log" | grep -v "^{" ;;
    cpacc)  python3 scripts/cp_accuracy.py --gpu --no-cpu --seq 8192 32768 2>&1 | tee "$OUT/cp_accuracy.log" ;;
    gs)     python3 examples/getting_started.py 2>&1 | tee "$OUT/getting_started.log" ;;
    demo|demo:*) a=${s#demo}; a=${a#:}
            python3 -m tritium demo --out /tmp/demo ${a//+/ } 2>&1 | tr '\r' '\n' | grep -v "^step" | tee "$OUT/demo.log" | tail -30
            mkdir -p "$OUT/demo"; cp /tmp/demo/*.png /tmp/demo/*.csv /tmp/demo/*.md /tmp/demo/*.json "$OUT/demo/" 2>/dev/null ;;
    ncu|ncu:*) a=${s#ncu}; a=${a#:}
            ncu_bin=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
            "$ncu_bin" --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \
              --section SchedulerStats --section WarpStateStats --section InstructionStats \
              -k "regex:_fwd_kernel|_bwd_kernel|_dq_kernel|_dkdv_kernel" \
              python3 benchmarks/bench_flash_attention.py --kernels --once ${a//+/ } \
              > "$OUT/ncu_flash.log" 2>&1
            grep -E "^  _[a-z_]+kernel|launched|Duration|Issue Slots Busy|highest-utilized|Warp Cycles Per Issued|at a CTA" \
              "$OUT/ncu_flash.log" | head -300 ;;
    blockscale) python3 benchmarks/bench_block_scaling.py 2>&1 | tee "$OUT/bench_block_scaling.log" | grep -v "^{" ;;
    moe)    python3 benchmarks/bench_moe.py 2>&1 | tee "$OUT/bench_moe.log" | grep -v "^{" ;;
    moe:*)  a=${s#moe:}; python3 benchmarks/bench_moe.py ${a//+/ } 2>&1 | tee "$OUT/bench_moe_stages.log" | grep -v "^{" ;;
    block)  python3 benchmarks/bench_block.py 2>&1 | tee "$OUT/bench_block.log" | grep -v "^{" ;;
    block:*) python3 benchmarks/bench_block.py --only "${s#block:}" 2>&1 | tee "$OUT/bench_block.log" | grep -v "^{" ;;
    model)  python3 benchmarks/bench_model.py 2>&1 | tee "$OUT/bench_model.log" | grep -v "^{" ;;
    modelprof:*) python3 benchmarks/bench_model.py --profile "${s#modelprof:}" 2>&1 | tee "$OUT/bench_model_profile.log" | tail -60 ;;
    model:*) v=${s#model:}; v=${v//,/ }; python3 benchmarks/bench_model.py --only ${v//+/ } 2>&1 | tee "$OUT/bench_model.log" | grep -v "^{" ;;
    mtests) python3 -m pytest -q -m multigpu tests/gpu 2>&1 | tee "$OUT/gpu_mtests.log" | tail -25 ;;
    tp)     torchrun --standalone --nproc_per_node=2 benchmarks/bench_tp.py 2>&1 | tee "$OUT/bench_tp.log" | grep -v "^{" ;;
    tp:*)   a=${s#tp:}; torchrun --standalone --nproc_per_node=2 benchmarks/bench_tp.py ${a//+/ } 2>&1 | tee "$OUT/bench_tp.log" | grep -v "^{" ;;
    fsdp)   torchrun --standalone --nproc-per-node="$ngpu" benchmarks/bench_fsdp.py 2>&1 | tee "$OUT/bench_fsdp_$ngpu.log" | grep -v "^{" ;;
    fsdp:*) a=${s#fsdp:}; torchrun --standalone --nproc-per-node="$ngpu" benchmarks/bench_fsdp.py ${a//+/ } 2>&1 | tee "$OUT/bench_fsdp_$ngpu.log" | grep -v "^{" ;;
    pack)   t=$(mktemp -d); (cd "$OUT" && tar czf "$t/out.tgz" . && find . -name "*.json" \
               -exec cp {} "$t/" \; && rm -rf ./* && mv "$t"/* .); ls "$OUT" ;;
    tests:*) e=${s#tests:}; python3 -m pytest -q --continue-on-collection-errors -m "gpu or multigpu" tests -k "${e//+/ }" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
  esac
done
