#!/usr/bin/env bash
# Usage: scripts/gpu_parallel.sh 'GPUS:STAGE STAGE ...' ['GPUS:STAGE ...' ...]
#   e.g. scripts/gpu_parallel.sh '0:tests:attention graphs' '1:model:tritium_fp8_delayed' '2,3:tp'
# Several scripts/gpu_check.sh jobs side by side on one machine, each on its own GPUs
# (CUDA_VISIBLE_DEVICES=GPUS), its logs and results in $OUT/g<GPUS>/ (commas become dashes);
# a job's stages run in order. Environment variables set before the call reach every job; one
# job's own go in front of its stages ('2,3:CUDA_DEVICE_MAX_CONNECTIONS=1 tp'). At the end
# everything under $OUT is packed into $OUT/out.tgz and each job's log tail printed (a caller
# that fetches few files gets all of them). Jobs beside each other share the host's CPUs:
# compare timings within one job, or rerun a baseline alone.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/peers/torchao ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/peers .whl/*.whl   # once, before the jobs (gpu_check.sh then skips it)
fi
for job in "$@"; do
  gpus=${job%%:*}; stages=${job#*:}; dir="$OUT/g${gpus//,/-}"; mkdir -p "$dir"
  ( export CUDA_VISIBLE_DEVICES=$gpus OUT=$dir
    envs=(); args=()
    for word in $stages; do
      if [[ $word == *=* && $word != *:* ]]; then envs+=("$word"); else args+=("$word"); fi
    done
    env "${envs[@]}" scripts/gpu_check.sh "${args[@]}" > "$dir/job.log" 2>&1 ) &
done
wait
for log in "$OUT"/g*/job.log; do echo "=== ${log#$OUT/}"; tail -15 "$log"; done
t=$(mktemp -d); (cd "$OUT" && tar czf "$t/out.tgz" . && rm -rf ./* && mv "$t/out.tgz" .)
ls -la "$OUT"
