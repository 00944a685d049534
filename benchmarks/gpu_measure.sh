#!/usr/bin/env bash
# What autoplan measures on a CUDA GPU, in one run of a few minutes (issue 14: the cost model's
# error on H100), written into OUTDIR:
#   gpu.txt          the card, driver, clocks, power limit, torch and CUDA
#   full-step.json   the 1.7B validation row's whole step on this one GPU, as Megatron-LM holds
#                    it, profiled (benchmarks/gpu_full_step.py; compare anywhere with
#                    `python benchmarks/gpu_full_step.py OUTDIR/full-step.json`)
#   layers.json      one rank's transformer layer of each H100 validation row, part by part
#                    (benchmarks/gpu_layers.py; compare anywhere with
#                    `python benchmarks/gpu_layers.py OUTDIR/layers.json`)
#   calibration.json autoplan's device calibration (`autoplan profile --calibrate-only`)
#   plan.json, run.json   a GPT-3 1.3B plan for this one GPU, trained for a few steps by
#                    autoplan's runtime: measured step time and peak memory beside the plan's
#
#   usage: bash benchmarks/gpu_measure.sh OUTDIR
# Each step has its own time limit, so one that fails or hangs leaves the others' results.
set -u
out=${1:?usage: bash benchmarks/gpu_measure.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,power.limit,temperature.gpu \
    --format=csv
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$out/gpu.txt"
step() { echo "== $*"; local t0=$SECONDS; "$@"; echo "== rc $? in $((SECONDS - t0)) s"; }
step timeout 120 $py benchmarks/gpu_full_step.py --measure "$out/full-step.json"
step timeout 300 $py benchmarks/gpu_layers.py --measure "$out/layers.json"
step timeout 120 $py -m autoplan.cli.main profile --calibrate-only --device cuda \
  -o "$out/calibration.json"
# micro-batches of 2: on an H100 80GB the planner's own choice (4, 68.3 GiB predicted) ran out
# of memory on 2026-11-26 (autocast's fp32 softmax and norms and bf16 weight copies unpriced)
step timeout 90 $py -m autoplan.cli.main plan gpt3-1.3b --cluster local --global-batch 8 \
  --force micro_batch_size=2 -o "$out/plan.json"
step timeout 240 $py -m torch.distributed.run --nproc-per-node=1 --master-port=29511 \
  -m autoplan.runtime.worker --plan "$out/plan.json" --model gpt3-1.3b --steps 5 --lr 0.0003 \
  --json "$out/run.json"
