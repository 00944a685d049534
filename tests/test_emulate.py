"""`autoplan emulate`: one rank of a plan for many ranks, alone, its collectives faked.

At small size on CPU: a tensor x pipeline x data-parallel plan for 8 ranks and a ZeRO-3 plan,
one rank each. What is checked is that the emulated rank is the plan's rank R (the weights it
holds are its shards, as the plan says), that its step runs and is timed, and that its peak
memory is measured and near the plan's prediction for its stage (tiny models carry more
fixed overhead than the planner prices, so "near" is within 0.5-2x here).
"""

import subprocess
import sys

import pytest

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.sharding.mesh_axes import MeshAxis


def _plan(force, world, tmp_path):
    small = build_example("gpt-tiny", batch_size=1, device="meta")
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    p = make_plan(g, Cluster.local(world), global_batch_size=8, precision="fp32",
                  profile=None, force=force, max_pp=force.get("pp", 1))
    path = tmp_path / "plan.json"
    p.save(path)
    return p, path


@pytest.mark.parametrize("force,world,rank", [
    (dict(dp=2, tp=2, pp=2, zero_stage=1), 8, 7),
    (dict(dp=4, tp=2, zero_stage=3), 8, 5),
    (dict(dp=8, tp=1, zero_stage=1), 8, 3),          # DDP: its reducer under the fake group
], ids=["dp2-tp2-pp2-rank7", "zero3-dp4-tp2-rank5", "ddp-dp8-rank3"])
def test_one_rank_of_an_8_rank_plan_runs_alone(force, world, rank, tmp_path):
    p, path = _plan(force, world, tmp_path)
    out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "emulate", str(path),
                          "--model", "gpt-tiny", "--rank", str(rank), "--steps", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    stage = p.config.dims.index(rank, MeshAxis.PP)
    assert f"rank {rank} of {world}" in text and f"pipeline stage {stage}" in text
    assert "collectives move nothing" in text
    assert "median of 2" in text                         # the first step is not timed
    ratio = float(text.split("peak memory")[1].split("ratio")[1].split()[0])
    assert 0.5 <= ratio <= 2.0, text


def _rank_5_of_dp2_tp2_pp2(precision, zero_stage):
    """(the example on meta, the dp2 x tp2 x pp2 plan of gpt-tiny on 8 CPU ranks, rank 5's
    emulation over 2 steps, that rank's prediction)."""
    from autoplan.runtime.emulate import emulate, predicted_for_rank
    small = build_example("gpt-tiny", batch_size=1, device="meta")
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    p = make_plan(g, Cluster.local(8), global_batch_size=8, precision=precision, profile=None,
                  force=dict(dp=2, tp=2, pp=2, zero_stage=zero_stage), max_pp=2)
    e = emulate(p, small.model, example_inputs=small.example_inputs,
                example_targets=small.targets, loss_fn=small.loss_fn, rank=5, steps=2)
    return small, p, e, predicted_for_rank(p, 5)


def test_the_emulated_rank_holds_its_shards_and_compares_with_its_stage():
    """In process: rank 5 of a dp2 x tp2 x pp2 plan holds exactly the weights of its pipeline
    stage's tensor-parallel shard (the plan's weight bytes for that stage), and the prediction
    it is compared with is that stage's."""
    import torch.distributed as dist

    from autoplan.runtime.emulate import emulate
    small, p, e, want = _rank_5_of_dp2_tp2_pp2("fp32", zero_stage=0)
    assert not dist.is_initialized()                   # its fake group is gone
    assert e.predicted == want and want.stage == p.config.dims.index(5, MeshAxis.PP) == 1
    assert e.weight_bytes == want.weight_bytes
    assert e.peak_memory_bytes > e.weight_bytes and len(e.step_s) == 1
    from autoplan import PlanError
    with pytest.raises(PlanError, match="ranks 0 to 7"):
        emulate(p, small.model, example_inputs=small.example_inputs,
                example_targets=small.targets, loss_fn=small.loss_fn, rank=8)


def test_a_bf16_rank_holds_its_fp32_weights_as_predicted():
    """Under autocast the plan's weights count the 16-bit copies each forward makes (kept to
    backward, in the peak); between steps the rank holds its fp32 shards alone, and that is
    what the measured weights are compared with (the H200 check compared them with the plan's
    weights, copies included: 6.74 vs 10.12 GiB)."""
    _, p, e, want = _rank_5_of_dp2_tp2_pp2("bf16", zero_stage=1)
    mem = p.predicted["stages"][want.stage]["memory"]
    assert want.copy_bytes == pytest.approx(float(mem["params_bytes"]) / 3)   # 2 of 4 + 2
    assert e.weight_bytes == pytest.approx(want.weight_bytes, rel=1e-3)
    assert "autocast's 16-bit copies" in e.report()


def test_vocab_parallel_cross_entropy_holds_one_fp32_copy_of_the_logits():
    """The vocabulary-parallel loss works in place (Megatron-LM's): over its bf16 logits it
    holds one fp32 copy (the softmax, then the gradient) and the bf16 gradient. Out of place it
    held four fp32 copies at once: rank 0 of the dp8 x tp8 ZeRO-3 Llama-3-8B plan ran out of
    an H200's memory allocating the fourth (3.91 GiB: 8 x 8192 tokens x 128256/8 x 4 bytes)."""
    import torch
    import torch.nn.functional as F

    from autoplan.runtime.emulate import LiveBytes
    from autoplan.runtime.kernels import _VocabCrossEntropy

    class OneRank:                       # a vocabulary split one way: all-reduces are copies
        rank = 0

        def all_reduce(self, x, op=None):
            return x.clone()

    torch.manual_seed(0)
    rows, vocab = 256, 1000
    logits = torch.randn(rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (rows,))
    target[3] = -100
    live = LiveBytes([logits, target])
    with live.mode:
        loss = _VocabCrossEntropy.apply(logits, target, OneRank(), -100).sum()
        loss.backward()
    fp32_copy = rows * vocab * 4
    extra = live.peak - logits.nbytes - target.nbytes
    assert fp32_copy <= extra <= 1.5 * fp32_copy + 64 * rows, (extra, fp32_copy)
    ref_logits = logits.detach().float().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, target, reduction="sum")
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    assert torch.allclose(logits.grad.float(), ref_logits.grad, atol=1e-2, rtol=0)


def test_a_cpu_clusters_plan_of_llama_emulates_from_the_cli(tmp_path):
    """`autoplan plan` traces a CPU cluster's model on the CPU, where Llama's attention output
    is a view of the kernel's result (a copy on the meta device): emulate builds the model
    where plan traced it, and the fingerprint leaves the view out, so either device agrees
    (emulate refused the plan before both)."""
    from autoplan.cli.main import main
    path = tmp_path / "p.json"
    assert main(["plan", "llama-tiny", "--cluster", "local:2", "--global-batch", "4",
                 "-o", str(path)]) == 0
    out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "emulate", str(path),
                          "--model", "llama-tiny", "--steps", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 0 of 2" in out.stdout and "median of 1" in out.stdout
    on_meta = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "emulate", str(path),
                              "--model", "llama-tiny", "--steps", "2", "--device", "meta"],
                             capture_output=True, text=True, timeout=300)
    assert on_meta.returncode == 0, on_meta.stderr[-3000:]
