#!/usr/bin/env bash
# The one prepared GPU check (issue 36), at most 8 minutes on one GPU, written into OUTDIR:
#   gpu.txt         the card, driver, torch and CUDA
#   zoo.json        every zoo model in bf16 against eager torch.autocast (benchmarks/gpu_check.py)
#   speed.json      HF Llama 0.89B and GPT-3 1.3B: autoplan eager and compiled, eager PyTorch,
#                   torch.compile by hand; step time, peak memory, autoplan's predictions
#   emulate.json    one rank of two 64-GPU Llama-3-8B plans alone on this GPU
#   full-step.json  the 1.7B validation row's whole step (benchmarks/gpu_full_step.py)
#   fp8.txt, fp8.json  fp8 plans: the GPU test against torchao by hand, and bf16 against fp8
#                   step times of HF Llama 0.89B (benchmarks/gpu_fp8.py); only with PARTS=...fp8
#   calibrate.txt, profiles/  `autoplan calibrate` of a one-GPU GPT-3 1.3B plan (eager, bf16):
#                   its phases read off the CUDA kernels, and this GPU's refit profile; only
#                   with PARTS=...calibrate (its time is unmeasured: a limit of 180 s)
#   gpu-check.json, gpu-check.md   all of it, and one table
#
#   usage: [PARTS="zoo speed emulate full fp8 calibrate"] bash benchmarks/gpu_check.sh OUTDIR
# PARTS picks the parts (default: zoo speed emulate full, about 8 minutes on an H200; fp8 adds 1).
# On the first H200 run (benchmarks/data/h200-gpu-check-20261127) compiling took most of the
# speed part: HF Llama's four variants 171 s, GPT-3 1.3B's 271 s.
# Run from the repository root. Without network (a lent GPU machine), install what torch does
# not bring from wheels carried along first: WHEELS=DIR installs DIR/*.whl with --no-index.
# Each part has its own time limit, so one that fails or hangs leaves the others' results.
set -u
out=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -n "${WHEELS:-}" ]; then
  $py -m pip install -q --no-index --no-deps "$WHEELS"/*.whl 2>&1 | tail -2
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit \
    --format=csv 2>&1
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$out/gpu.txt"
step() { echo "== $*"; local t0=$SECONDS; "$@"; echo "== rc $? in $((SECONDS - t0)) s"; }
parts=" ${PARTS:-zoo speed emulate full} "
has() { [[ "$parts" == *" $1 "* ]]; }
has zoo && step timeout 70 $py benchmarks/gpu_check.py zoo --out "$out/zoo.json"
has speed && step timeout 320 $py benchmarks/gpu_check.py speed --steps 5 --out "$out/speed.json"
has emulate && step timeout 60 $py benchmarks/gpu_check.py emulate --out "$out/emulate.json"
has full && step timeout 30 $py benchmarks/gpu_full_step.py --measure "$out/full-step.json"
has fp8 && step timeout 60 bash -c "$py -m pytest -q -p no:cacheprovider tests/test_fp8_precision.py -k one_gpu > '$out/fp8.txt' 2>&1; $py benchmarks/gpu_fp8.py --steps 4 --out '$out/fp8.json'"
has calibrate && step timeout 180 bash -c "export AUTOPLAN_PROFILE_DIR='$out/profiles'; $py -m autoplan.cli.main plan gpt3-1.3b --cluster local:1 --global-batch 8 --precision bf16 --force compiled=false --force micro_batch_size=4 -q -o '$out/calibrate-plan.json' && $py -m autoplan.cli.main calibrate '$out/calibrate-plan.json' --model gpt3-1.3b --steps 3 --warmup 2 > '$out/calibrate.txt' 2>&1"
$py benchmarks/gpu_check.py table "$out/zoo.json" "$out/speed.json" "$out/emulate.json" \
  "$out/full-step.json" --out "$out/gpu-check.json"
