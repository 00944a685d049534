#!/usr/bin/env bash
# Every memory and precision option (issue 39) as a user meets it: `autoplan plan` with the
# option forced (or searched), `autoplan inspect`, then `autoplan run` for 3 steps on 2 CPU
# ranks, on HF Llama built from its config (hf-llama-gqa-tiny). fp8 and NVMe plans are made for
# an H100 and an A100 node and must be refused here by their own reason (run with
# --allow-cluster-mismatch so that the cluster check does not answer first). About 6 minutes.
#   usage: bash benchmarks/memory_options_cli.sh [WORKDIR]     (AUTOPLAN=path/to/autoplan)
set -u
A=${AUTOPLAN:-autoplan}
M=hf-llama-gqa-tiny
W=${1:-${TMPDIR:-/tmp}/autoplan-options}; rm -rf "$W"; mkdir -p "$W"; cd "$W"
ok=0; bad=0
try() {  # name, expect (ok, or what the refusal must say), plan args...
  local name=$1 expect=$2; shift 2
  echo "=== $name"
  if ! $A plan $M --cluster local:2 --global-batch 8 "$@" -o $name.plan.json > $name.plan.txt 2>&1; then
    echo "PLAN FAILED"; tail -5 $name.plan.txt; bad=$((bad+1)); return; fi
  grep -m1 "^plan\|config" $name.plan.txt | head -2
  $A inspect $name.plan.json > $name.inspect.txt 2>&1 || { echo "INSPECT FAILED"; tail -3 $name.inspect.txt; bad=$((bad+1)); return; }
  local more=""; [ "$expect" != ok ] && more=--allow-cluster-mismatch
  $A run $name.plan.json --model $M --steps 3 $more > $name.run.txt 2>&1; rc=$?
  if [ "$expect" = ok ] && [ $rc = 0 ]; then echo "ran: $(grep -m1 'measured step' $name.run.txt | cut -c1-120)"; ok=$((ok+1));
  elif [ "$expect" != ok ] && [ $rc != 0 ] && grep -q "error: .*$expect" $name.run.txt; then echo "refused as expected: $(grep -m1 'error' $name.run.txt | cut -c1-160)"; ok=$((ok+1));
  else echo "UNEXPECTED rc=$rc"; tail -8 $name.run.txt; bad=$((bad+1)); fi
}
try ops ok --precision fp32 --force recompute=ops --force dp=2
try layers ok --precision fp32 --force layer_recompute=none,ops --force dp=2
try actoff ok --precision bf16 --force offload_activations=1 --force dp=2
try layeroff ok --precision bf16 --force layer_offload=true,false --force layer_recompute=none,full --force dp=2
try adam8 ok --precision bf16 --force optimizer_state=8bit --force dp=2
try adambf16 ok --precision bf16 --force optimizer_state=bf16 --force tp=2
try params ok --precision bf16 --force mixed_precision=params --force dp=2 --force zero_stage=1
try auto ok --precision auto
try lossy ok --precision bf16 --allow-lossy
try powersgd ok --precision fp32 --force grad_compression=powersgd --force dp=2
try fp8 "runs its linear layers in fp8" --precision bf16 --force fp8=tensorwise --cluster dgx-h100/1
try nvme "on NVMe" --precision bf16 --force offload_optimizer=true --force offload_nvme=true --cluster dgx-a100-80gb/1
echo "as expected: $ok, not: $bad"; [ $bad = 0 ]
