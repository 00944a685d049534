"""Checkpoints on gloo: save, resume in new processes, reshard to another plan.

- Every plan family: 6 uninterrupted steps (saving after step 3) against new processes that
  resume from that checkpoint and run steps 4-6. Losses and parameters must be bitwise equal
  (fp32): a resumed run is the same run.
- Resharding: saved under plan A, resumed under plan B; the next losses equal A's uninterrupted
  run within 1e-6 relative. Each uninterrupted run is launched once per module: the family's
  resume and the resharding tests from that plan read the same checkpoint.
- Refusals: a checkpoint of another model or optimizer says what differs; a save that dies
  midway leaves the previous checkpoint the latest.
The pieces each rank writes are checked on their own too: put back together from every rank
they are the whole tensor, for every placement and FSDP slab.
"""

import functools
import json

import pytest
import torch

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.errors import CheckpointError
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from autoplan.runtime.checkpoint_pieces import Segment, restrict, tp_segments
from autoplan.runtime.tp_comm import local_piece
from autoplan.sharding.placement import REPLICATE, shard
from tests.distributed import run_ranks
from tests.test_runtime import GLOBAL_BATCH, _optimizer

NAME = "gpt-tiny"
OVERRIDES = dict(num_layers=4, num_heads=2)


def _example(batch, name=NAME, **overrides):
    return build_example(name, batch_size=batch, seed=0, **(overrides or OVERRIDES))


@functools.lru_cache(maxsize=None)
def _graph(name, overrides):
    """The model traced at batch 1, once per model: every plan of it is made from this graph."""
    small = _example(1, name, **dict(overrides))
    return trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)


def _plan(world, force, sharding="megatron", max_pp=1, name=NAME, overrides=None):
    g = _graph(name, tuple(sorted((overrides or {}).items())))
    return make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision="fp32",
                     profile=None, force=force, sharding=sharding, max_pp=max_pp)


def _train(rank, world, plan_json, ckpt, *, steps, save_at=None, resume=None,
           async_save=False, name=NAME, overrides=None, optimizer=None):
    from autoplan.runtime.trainer import compile
    overrides = overrides or {}
    ex = _example(GLOBAL_BATCH, name, **overrides)
    small = _example(1, name, **overrides)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn,
                      optimizer=optimizer or _optimizer, global_batch_size=GLOBAL_BATCH,
                      plan=Plan.from_json(plan_json), resume=resume)
    start = trainer.steps_done
    batch = tuple(ex.example_inputs) + (ex.targets,)
    losses = []
    for _ in range(steps):
        losses.append(trainer.step(batch))
        if trainer.steps_done == save_at:
            trainer.save(ckpt, async_save=async_save)
    trainer.wait_for_checkpoint()
    sd = trainer.full_state_dict()      # a pipeline rank: its stage's tensors
    return start, losses, {k: v.tolist() for k, v in sd.items()}


def _whole(results):
    """Every rank's tensors in one dict (pipeline stages hold different ones)."""
    out = {}
    for _, _, sd in results:
        out.update(sd)
    return out


FAMILIES = [
    # (world, forced fields, sharding, max_pp, label). Left out as redundant here, each path
    # being covered by another family (their training is tested in tests/test_runtime.py and
    # tests/test_pipeline_runtime.py): ZeRO-2 (the runtime's ZeRO-2 is FSDP2 without resharding
    # after forward, its checkpoint the same sharded parameters as FSDP2's), FSDP x TP (every
    # piece of its checkpoint, FSDP slabs of tp shards, is in "FSDP x TP, attention whole",
    # whose MLP, embedding and norms are sharded so, beside its whole attention) and pp2
    # interleaved 1F1B (two chunks per rank: ZB-V; a tied weight on two ranks: pp2 1F1B).
    (2, dict(tp=1, zero_stage=0), "ilp", 1, "DDP"),
    (2, dict(tp=1, zero_stage=1), "ilp", 1, "ZeRO-1"),
    (2, dict(tp=1, zero_stage=3), "ilp", 1, "FSDP2"),
    (2, dict(tp=2, sequence_parallel=True), "megatron", 1, "TP + SP"),
    (4, dict(dp=2, tp=2, zero_stage=1), "megatron", 1, "ZeRO-1 x TP"),
    (4, dict(dp=2, tp=2, zero_stage=3, dp_whole=("layers.*.attn.*",)), "megatron", 1,
     "FSDP x TP, attention whole"),
    (4, dict(tp=1, zero_stage=3, dp_shard=2), "ilp", 1, "HSDP"),
    (2, dict(tp=1, zero_stage=0, offload_optimizer=True), "ilp", 1, "optimizer offload"),
    (2, dict(tp=1, zero_stage=3, offload_params=True), "ilp", 1, "FSDP2 CPU offload"),
    (2, dict(pp=2, schedule="1f1b"), "megatron", 2, "pp2 1F1B"),
    (4, dict(pp=2, tp=2, schedule="1f1b"), "megatron", 2, "pp2 x tp2"),
    # the V puts the tied embedding and LM head on rank 0, in two chunks
    (2, dict(pp=2, schedule="zbv", virtual_stages=2), "megatron", 2, "pp2 ZB-V"),
]
# the plans runs start from: the families, and one only resharded from
SOURCES = {f[-1]: f[:-1] for f in FAMILIES}
SOURCES["pp2 DualPipeV"] = (2, dict(pp=2, schedule="dualpipev", virtual_stages=2), "megatron", 2)


def _run(world, plan_json, ckpt, **kw):
    return run_ranks(_train_kw, world, plan_json, ckpt, kw)


def _train_kw(rank, world, plan_json, ckpt, kw):
    return _train(rank, world, plan_json, ckpt, **kw)


def _bitwise_same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(torch.tensor(a[k]), torch.tensor(b[k])), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``label -> (plan, checkpoint root, every rank's results)`` of a plan of SOURCES run for 6
    uninterrupted steps, saving after step 3; run once, on first use: the family's resume test
    and the resharding tests from that plan resume from the same checkpoint."""
    runs = {}

    def run(label):
        if label not in runs:
            world, force, sharding, max_pp = SOURCES[label]
            plan = _plan(world, force, sharding, max_pp)
            for k, v in force.items():
                assert getattr(plan.config, k) == v, (k, plan.config)
            ckpt = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
            async_save = label == "FSDP2"            # one family saves in the background
            runs[label] = (plan, ckpt, _run(world, plan.to_json(), ckpt, steps=6, save_at=3,
                                            async_save=async_save))
        return runs[label]
    return run


@pytest.mark.parametrize("world,force,sharding,max_pp,label", FAMILIES,
                         ids=[f[-1] for f in FAMILIES])
def test_resume_is_the_same_run(uninterrupted, world, force, sharding, max_pp, label):
    plan, ckpt, full = uninterrupted(label)
    resumed = _run(world, plan.to_json(), ckpt, steps=3, resume=ckpt)
    for (start, losses, _), (_, full_losses, _) in zip(resumed, full):
        assert start == 3
        assert losses == full_losses[3:]            # bitwise
    _bitwise_same(_whole(resumed), _whole(full))


RESHARD = [
    # (plan A of SOURCES, world B, force B, label); B planned with Megatron sharding, max_pp 2
    ("ZeRO-1", 2, dict(tp=2, sequence_parallel=True), "dp2 ZeRO-1 -> tp2"),
    ("FSDP2", 2, dict(pp=2, schedule="1f1b"), "FSDP -> pp2"),
    ("pp2 1F1B", 2, dict(tp=1, zero_stage=0), "pp2 -> dp2"),
    ("pp2 DualPipeV", 2, dict(pp=2, schedule="1f1b"), "pp2 DualPipeV -> pp2 1F1B"),
    ("HSDP", 2, dict(tp=2, sequence_parallel=True), "HSDP 2x2 -> tp2"),
    ("FSDP x TP, attention whole", 2, dict(tp=1, zero_stage=0, offload_optimizer=True),
     "FSDP x TP attention whole -> dp2 offload"),
    ("FSDP x TP, attention whole", 2, dict(tp=1, zero_stage=3),
     "FSDP x TP attention whole -> FSDP"),
]


@pytest.mark.parametrize("source,wb,fb,label", RESHARD, ids=[r[-1] for r in RESHARD])
def test_resume_under_another_plan(uninterrupted, source, wb, fb, label):
    _, ckpt, full = uninterrupted(source)
    b = _plan(wb, fb, max_pp=2)
    resumed = _run(wb, b.to_json(), ckpt, steps=3, resume=ckpt)
    want = full[0][1][3:]
    for start, losses, _ in resumed:
        assert start == 3
        assert losses == pytest.approx(want, rel=1e-6)
    got, ref = _whole(resumed), _whole(full)
    assert set(got) == set(ref)
    for k in ref:
        g, r = torch.tensor(got[k]), torch.tensor(ref[k])
        assert (g - r).norm() <= 1e-5 * max(r.norm(), 1e-12), k


def _sgd(params):
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def test_checkpoint_of_another_model_or_optimizer_is_refused(uninterrupted):
    plan, ckpt, _ = uninterrupted("DDP")            # (AdamW, saved after step 3)
    other = dict(num_layers=2, num_heads=2)
    other_plan = _plan(2, dict(tp=1, zero_stage=0), "ilp", overrides=other)
    with pytest.raises(RuntimeError, match=r"CheckpointError.*another model.*lacks"):
        _run(2, other_plan.to_json(), ckpt, steps=1, resume=ckpt,
                  overrides=other)
    with pytest.raises(RuntimeError, match=r"CheckpointError.*AdamW state.*SGD"):
        _run(2, plan.to_json(), ckpt, steps=1, resume=ckpt, optimizer=_sgd)


def test_a_save_that_dies_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """One process (no process group): a save that fails midway is never the latest."""
    import torch.distributed.checkpoint as dcp

    from autoplan.runtime import checkpoint as ck
    plan = _plan(1, dict(tp=1))
    root = tmp_path / "ckpt"
    _, losses, _ = _train(0, 1, plan.to_json(), str(root), steps=2, save_at=1)
    assert (root / "latest").read_text().strip() == "step-00000001"
    real_save = dcp.save

    def dying_save(sd, **kw):
        real_save({k: v for i, (k, v) in enumerate(sd.items()) if i < 3}, **kw)
        raise OSError("disk gone")
    monkeypatch.setattr(ck.dcp, "save", dying_save)
    with pytest.raises(OSError):       # the same run, resumed, dies saving step 2
        _train(0, 1, plan.to_json(), str(root), steps=1, save_at=2, resume=str(root))
    monkeypatch.setattr(ck.dcp, "save", real_save)
    assert (root / "latest").read_text().strip() == "step-00000001"
    assert ck.resolve(root).name == "step-00000001"
    assert list(root.glob(".step-00000002.partial"))       # what the failed save left
    start, again, _ = _train(0, 1, plan.to_json(), str(root), steps=1, resume=str(root))
    assert start == 1 and again == losses[1:]
    meta = json.loads((root / "step-00000001" / "autoplan.json").read_text())
    assert meta["step"] == 1 and meta["samples_seen"] == GLOBAL_BATCH


def test_resolve_refuses_what_is_not_a_checkpoint(tmp_path):
    from autoplan.runtime.checkpoint import resolve
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(tmp_path / "nope")
    (tmp_path / ".step-00000004.partial").mkdir()
    with pytest.raises(CheckpointError, match="never finished"):
        resolve(tmp_path)
    (tmp_path / "latest").write_text("../../etc")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve(tmp_path)


# ---- the pieces, without processes -------------------------------------------------------------

def _assemble(full, parts):
    out = torch.full_like(full, float("nan"))
    for segs, local in parts:
        for combo in __import__("itertools").product(*segs):
            src, dst = local, out
            for d, s in enumerate(combo):
                src = src.narrow(d, s.local_start, s.length)
                dst = dst.narrow(d, s.global_start, s.length)
            dst.copy_(src)
    return out


@pytest.mark.parametrize("placement", [REPLICATE, shard(0), shard(1), shard(0, 3), shard(1, 2)])
@pytest.mark.parametrize("t,dp", [(1, 2), (2, 1), (2, 3), (4, 2)])
def test_pieces_of_all_ranks_make_the_whole_tensor(placement, t, dp):
    full = torch.arange(24 * 16, dtype=torch.float32).reshape(24, 16)
    parts = []
    for r in range(t):
        local = local_piece(full, placement, t, r)
        segs = tp_segments(tuple(full.shape), placement, t, r)
        for d in range(dp):                       # FSDP2: uneven chunks of local dim 0
            chunk = -(-local.shape[0] // dp)
            lo, hi = min(d * chunk, local.shape[0]), min((d + 1) * chunk, local.shape[0])
            parts.append((restrict(segs, 0, lo, hi - lo), local[lo:hi]))
    assert torch.equal(_assemble(full, parts), full)


def test_block_segments():
    segs = tp_segments((12, 4), shard(0, 3), 2, 1)
    assert segs[0] == [Segment(0, 2, 2), Segment(2, 6, 2), Segment(4, 10, 2)]
    assert restrict(segs, 0, 1, 3)[0] == [Segment(0, 3, 1), Segment(1, 6, 2)]
