"""A loss averaged over counted targets (padding and prompt tokens at ``ignore_index``) trains
as on one device: the mean over the global batch's counted targets, not the mean of each data
parallel rank's and micro-batch's means (which differ where their counts differ: 3.5e-5 on the
first loss of a padded batch under dp2, before the fix)."""

import pytest
import torch
import torch.nn.functional as F

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.graph import trace
from autoplan.graph.loss import TokenMeanLoss, step_weights, token_mean_loss
from autoplan.models import build_example
from autoplan.planner.planfile import Plan
from tests.distributed import run_ranks
from tests.test_runtime import train_one_device

GLOBAL_BATCH, STEPS = 8, 3


def _padded(ex):
    """The example's targets with a different number of trailing tokens ignored per sample."""
    y = ex.targets.clone()
    for i in range(y.shape[0]):
        pad = (3 * i) % 7
        if pad:
            y[i, -pad:] = -100
    return y


def _graph(loss_fn, name="gpt-tiny"):
    ex = build_example(name, batch_size=1, seed=0)
    return trace(ex.model, ex.example_inputs, loss_fn=loss_fn, targets=ex.targets)


def test_the_loss_is_found_as_a_token_mean_only_where_it_is_one():
    ex = build_example("gpt-tiny", batch_size=1, seed=0)
    assert token_mean_loss(_graph(ex.loss_fn)) == TokenMeanLoss(target_input=1,
                                                                ignore_index=-100)

    def ce(out, y, **kw):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), **kw)
    assert token_mean_loss(_graph(lambda o, y: ce(o, y, ignore_index=0))).ignore_index == 0
    assert token_mean_loss(_graph(lambda o, y: ce(o, y, reduction="sum"))) is None
    assert token_mean_loss(_graph(lambda o, y: ce(o, y) + o.pow(2).mean())) is None
    # a causal LM's shift drops targets on their way to the loss: replayed on the input
    shifted = token_mean_loss(_graph(lambda o, y: ce(o[:, :-1], y[:, 1:])))
    assert shifted.prepare and shifted.prepare[0][:3] == ("slice", 1, 1)
    y = torch.tensor([[-100, 5, -100, 7]])
    assert shifted.counted(y) == 2 and TokenMeanLoss(1, -100).counted(y) == 2
    assert shifted.counted(torch.tensor([[3, -100, -100, -100]])) == 0
    # HF's own shift pads the labels with the ignore index, then slices off the first
    padded = token_mean_loss(_graph(lambda o, y: ce(
        o, F.pad(y, (0, 1), value=-100)[:, 1:])))
    assert [s[0] for s in padded.prepare] == ["pad", "slice"]
    assert padded.counted(torch.tensor([[3, 4, -100, 6]])) == 2
    assert token_mean_loss(_graph(lambda o, y: ce(o[:-1], y[1:]))) is None   # batch dim
    weight = torch.rand(ex.model(*ex.example_inputs).shape[-1])     # per class
    assert token_mean_loss(_graph(lambda o, y: ce(o, y, weight=weight))) is None


def test_micro_batch_weights_are_the_share_of_counted_targets():
    loss = TokenMeanLoss(target_input=1, ignore_index=-100)
    y = torch.zeros(8, 4, dtype=torch.long)
    assert step_weights(loss, y, 0, 2, 2) == [1.0, 1.0]           # equal counts: exactly 1
    y[0, :] = -100                                                 # sample 0 counts nothing
    w0, w1 = step_weights(loss, y, 0, 2, 2), step_weights(loss, y, 1, 2, 2)
    # rank 0's micro-batches hold 4 and 8 of 28 counted targets; 4 shares of 28 / 4 = 7 each
    assert w0 == pytest.approx([4 / 7, 8 / 7]) and w1 == pytest.approx([8 / 7, 8 / 7])
    assert sum(w0 + w1) == pytest.approx(4.0)
    assert step_weights(loss, torch.full((8, 4), -100), 0, 2, 2) is None
    assert step_weights(None, y, 0, 2, 2) is None


def _shifted(out, y):
    """A causal LM's loss written with its shift (HF's pads the labels, then slices)."""
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), y[:, 1:].reshape(-1))


def _loss_fn(ex, shifted):
    return _shifted if shifted else ex.loss_fn


def _rank(rank, world, plan_json, shifted=False):
    from autoplan.runtime.trainer import compile
    ex = build_example("gpt-tiny", batch_size=GLOBAL_BATCH, seed=0)
    small = build_example("gpt-tiny", batch_size=1, seed=0)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=_loss_fn(ex, shifted),
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6),
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json))
    batch = tuple(ex.example_inputs) + (_padded(ex),)
    return [trainer.step(batch) for _ in range(STEPS)]


def _reference(shifted=False):
    ex = build_example("gpt-tiny", batch_size=GLOBAL_BATCH, seed=0)
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-3, eps=1e-6)
    losses, _ = train_one_device(ex, opt, STEPS, loss_fn=_loss_fn(ex, shifted),
                                 targets=_padded(ex))
    return losses


@pytest.mark.parametrize("world,force,shifted", [
    (2, dict(tp=1, zero_stage=0, micro_batch_size=2), False),   # dp2, 2 micro-batches each
    (4, dict(tp=2, dp=2, zero_stage=3, micro_batch_size=2), False),
    (2, dict(pp=2, micro_batch_size=2), False),                  # 4 micro-batches in the pipe
    (2, dict(tp=1, zero_stage=1, micro_batch_size=2), True),
], ids=["dp2 x 2 micro-batches", "dp2 x tp2 FSDP", "pp2", "dp2, shifted targets"])
def test_a_padded_batch_trains_as_on_one_device(world, force, shifted):
    small = build_example("gpt-tiny", batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=_loss_fn(small, shifted),
              targets=small.targets)
    p = make_plan(g, Cluster.local(world), global_batch_size=GLOBAL_BATCH, precision="fp32",
                  profile=None, force=force, max_pp=force.get("pp", 1))
    ref = _reference(shifted)
    for losses in run_ranks(_rank, world, p.to_json(), shifted, timeout_s=240.0):
        assert losses == pytest.approx(ref, rel=1e-6), (p.config.short(), losses, ref)
