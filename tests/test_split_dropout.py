"""Dropout of a tensor split on the tensor-parallel axis draws a mask per rank.

Every rank of the axis seeds the process's generator alike, so that dropout on a replicated
tensor keeps the replicas identical. Left to that generator, dropout on a split tensor would
give every piece the same mask (head h dropped exactly where head h + H/t is on the next rank).
``kernels.split_random`` draws one seed from the generator (the same draw on every rank), offsets
it by the rank and runs the op on a generator of its own: masks differ between ranks, are the
same when the generator's state is the same (activation checkpointing's recomputed forward),
and the replicated dropouts stay in step.
"""

from types import SimpleNamespace

import pytest
import torch

from autoplan import Cluster
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan import plan as make_plan
from tests.distributed import run_ranks

DROPOUT = 0.3
GLOBAL_BATCH = 4


@pytest.mark.parametrize("op", [torch.ops.aten.dropout.default,
                                torch.ops.aten.native_dropout.default])
def test_each_rank_draws_its_own_mask_and_the_same_one_again(op):
    from autoplan.runtime.kernels import draws_randomness, split_random

    x = torch.ones(4, 64, 16)

    def run(rank, p=0.5):
        torch.manual_seed(0)
        out = split_random(op, [x, p, True], {}, SimpleNamespace(rank=rank))
        out = out[0] if isinstance(out, tuple) else out
        return out, torch.rand(1)              # what the process's generator gives next
    (a, next_a), (b, next_b), (a2, next_a2) = run(0), run(1), run(0)
    assert not torch.equal(a, b)               # ranks: masks of their own
    assert 0.4 < (a == 0).float().mean() < 0.6 and set(a.unique().tolist()) <= {0.0, 2.0}
    assert torch.equal(a, a2)                  # the same state: the same mask (recompute)
    assert torch.equal(next_a, next_b) and torch.equal(next_a, next_a2)   # one draw each
    torch.manual_seed(0)
    op(x, 0.0, True)
    as_the_op = torch.rand(1)
    out, after = run(0, p=0.0)                 # nothing to draw: the op itself, as it is
    assert torch.equal(out, x) and torch.equal(after, as_the_op)
    assert not draws_randomness(op, [x, 0.5, False], {})
    assert not draws_randomness(torch.ops.aten.add.Tensor, [x, x], {})
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    assert draws_randomness(sdpa, [x, x, x], {"dropout_p": 0.1})
    assert not draws_randomness(sdpa, [x, x, x], {})


def _plan(force):
    small = build_example("gpt-tiny", batch_size=1, seed=0, dropout=DROPOUT)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    return make_plan(g, Cluster.local(2), global_batch_size=GLOBAL_BATCH, precision="fp32",
                     profile=None, force=force, sharding="megatron", max_pp=1).to_json()


def _train(rank, world, plan_json):
    from torch import fx

    from autoplan.planner.planfile import Plan
    from autoplan.runtime.program_calls import kernel_split_random
    from autoplan.runtime.trainer import compile
    torch.manual_seed(0)
    ex = build_example("gpt-tiny", batch_size=GLOBAL_BATCH, seed=0, dropout=DROPOUT)
    small = build_example("gpt-tiny", batch_size=1, seed=0, dropout=DROPOUT)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    split = sum(n.target is kernel_split_random for m in trainer.model.modules()
                if isinstance(m, fx.GraphModule) for n in m.graph.nodes)
    batch = tuple(ex.example_inputs) + (ex.targets,)
    # one forward of the rank program, keeping where each dropout of the attention
    # probabilities (b, heads on this rank, s, s) dropped
    gm = next(m for m in trainer.model.modules() if isinstance(m, fx.GraphModule))
    dropped = []

    class Keep(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            name = str(n.target)
            if ("dropout" in name or "split_random" in name) and isinstance(out, torch.Tensor) \
                    and out.dim() == 4:
                dropped.append((out == 0).tolist())
            return out

        def call_module(self, target, args, kwargs):     # the layers' own graphs too
            sub = self.fetch_attr(target)
            if isinstance(sub, fx.GraphModule):
                return Keep(sub).run(*args, **kwargs)
            return super().call_module(target, args, kwargs)
    mbs = trainer.plan.config.micro_batch_size
    chunk = [b[:mbs] for b in batch]
    with torch.no_grad():
        Keep(gm).run(*(chunk if trainer.runner.loss_in_program else chunk[:-1]))
    losses = [trainer.step(batch) for _ in range(3)]
    # weights this rank holds whole (replicated on the axis): the same on both ranks only if
    # the dropouts of replicated tensors drew the same masks on both
    shapes = {k: v.shape for k, v in small.model.named_parameters()}    # left whole
    whole = {k: v.detach().clone() for k, v in trainer.model.named_parameters()
             if v.shape == shapes.get(k)}
    return split, losses, {k: v.tolist() for k, v in whole.items()}, dropped


def test_head_split_dropout_trains_with_rank_masks_and_replays_under_recompute():
    """gpt-tiny with dropout 0.3 under tp2 (heads split, the residual stream replicated): the
    attention dropout runs per rank, the replicated weights stay identical on both ranks, and
    full recomputation replays every mask (the same losses as without it)."""
    plain = run_ranks(_train, 2, _plan(dict(tp=2, sequence_parallel=False)))
    again = run_ranks(_train, 2, _plan(dict(tp=2, sequence_parallel=False, recompute="full")))
    for split, _, _, dropped in plain:
        assert split > 0 and len(dropped) == 2  # the attention probabilities' dropout
    for layer in range(2):                      # each rank's heads: masks of their own
        assert plain[0][3][layer] != plain[1][3][layer], layer
    assert plain[0][1] == pytest.approx(plain[1][1], abs=0)       # one loss on both ranks
    whole0, whole1 = plain[0][2], plain[1][2]
    assert whole0 and whole0.keys() == whole1.keys()
    for k in whole0:
        assert whole0[k] == whole1[k], k       # replicated weights stay replicas
    assert again[0][1] == pytest.approx(plain[0][1], rel=1e-6)    # recompute: same masks
