"""The stage partition: the min-max split equals brute force, memory moves recomputation to the
stages that hold the most micro-batches, and layers that differ from each other (a container
of mixed layer types) are split by their own costs."""

import itertools
import random

import pytest
import torch
from torch import nn

from autoplan import Cluster, ParallelConfig, estimate, plan
from autoplan.estimate.partition import (UnitChoice, min_max_split, partition,
                                         pipeline_units)
from autoplan.graph import trace

POLICIES = ("none", "selective", "full")


def _brute_force(costs, parts, first, last, flight, budget):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0,) + cuts + (n,)
        for pols in itertools.product(list(costs[0]), repeat=parts):
            worst = 0.0
            ok = True
            for c in range(parts):
                i, j = bounds[c], bounds[c + 1]
                t = sum(costs[k][pols[c]].time_s for k in range(i, j))
                a = sum(costs[k][pols[c]].activation_bytes for k in range(i, j))
                s = sum(costs[k][pols[c]].state_bytes for k in range(i, j))
                if c == 0:
                    t, a, s = t + first.time_s, a + first.activation_bytes, s + first.state_bytes
                if c == parts - 1:
                    t, a, s = t + last.time_s, a + last.activation_bytes, s + last.state_bytes
                if s + flight[c] * a > budget[c]:
                    ok = False
                    break
                worst = max(worst, t)
            if ok and (best is None or worst < best):
                best = worst
    return best


def _random_case(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 7)
    parts = rng.randint(1, min(4, n))
    pols = POLICIES[:rng.randint(1, 3)]
    costs = []
    for _ in range(n):
        t = rng.uniform(0.5, 2.0)
        a = rng.uniform(1.0, 4.0)
        costs.append({p: UnitChoice(time_s=t * (1 + 0.15 * k), activation_bytes=a / (1 + 2 * k),
                                    state_bytes=rng.uniform(0.5, 1.5))
                      for k, p in enumerate(pols)})
    first = UnitChoice(time_s=rng.uniform(0, 1), activation_bytes=rng.uniform(0, 1),
                       state_bytes=rng.uniform(0, 2))
    last = UnitChoice(time_s=rng.uniform(0, 2), activation_bytes=rng.uniform(0, 1),
                      state_bytes=rng.uniform(0, 1))
    flight = [float(parts - c) for c in range(parts)]            # 1F1B
    budget = [rng.uniform(4.0, 14.0)] * parts
    return costs, parts, first, last, flight, budget


@pytest.mark.parametrize("seed", range(40))
def test_min_max_split_equals_brute_force(seed):
    costs, parts, first, last, flight, budget = _random_case(seed)
    want = _brute_force(costs, parts, first, last, flight, budget)
    got = min_max_split(costs, parts, first=first, last=last, in_flight=flight,
                        budget_bytes=budget, rel_tol=1e-9)
    if want is None:
        assert got is None
        return
    assert got is not None and got.max_chunk_s == pytest.approx(want, rel=1e-6)
    assert sum(got.counts) == len(costs) and min(got.counts) >= 1


def test_split_balances_embedding_and_head():
    costs = [{"none": UnitChoice(time_s=1.0)}] * 16
    even = min_max_split(costs, 4)
    assert even.counts == (4, 4, 4, 4)
    # a head worth two layers: the last stage takes fewer layers than the busiest; ties in the
    # slowest chunk leave the remainder to the first stage (it holds the most micro-batches)
    s = min_max_split(costs, 4, last=UnitChoice(time_s=2.0))
    assert sum(s.counts) == 16 and s.counts[-1] < max(s.counts)
    assert s.max_chunk_s == pytest.approx(5.0, rel=1e-3)
    assert s.counts[0] == min(s.counts)


def test_memory_moves_recomputation_to_the_first_stages():
    """Under 1F1B stage s of 4 holds 4 - s micro-batches: with a budget that fits one layer's
    activations about 12 times, the first stage recomputes and the last does not."""
    costs = [{"none": UnitChoice(time_s=1.0, activation_bytes=1.0, state_bytes=0.1),
              "full": UnitChoice(time_s=1.33, activation_bytes=0.05, state_bytes=0.1)}] * 16
    s = min_max_split(costs, 4, in_flight=[4, 3, 2, 1], budget_bytes=[12.0] * 4)
    assert s is not None
    assert s.policies[0] == "full" and s.policies[-1] == "none"
    order = {p: k for k, p in enumerate(("none", "full"))}
    assert [order[p] for p in s.policies] == sorted((order[p] for p in s.policies), reverse=True)
    # and it beats recomputing everywhere (4 layers of 1.33 s per stage)
    assert s.max_chunk_s == pytest.approx(5.0, rel=1e-3) and s.counts[-1] == 5


def test_no_split_fits_returns_none():
    costs = [{"none": UnitChoice(time_s=1.0, activation_bytes=5.0)}] * 4
    assert min_max_split(costs, 2, in_flight=[2, 1], budget_bytes=[4.0, 4.0]) is None


# ------------------------------------------------------------ layers that differ
class Wide(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = nn.Linear(d, 8 * d), nn.Linear(8 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Narrow(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Scale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.gain


class MixedStack(nn.Module):
    """An input projection, a container of three kinds of layers (one of them once), a head.
    Written for pipelining: a stage without ``inp`` or ``head`` passes activations through."""

    def __init__(self, d=32):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList([Wide(d), Wide(d), Narrow(d), Narrow(d), Narrow(d),
                                     Scale(d), Narrow(d), Narrow(d)])
        self.head = nn.Linear(d, d)

    def forward(self, x):
        if self.inp is not None:
            x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) if self.head is not None else x


def mixed_graph(batch=4, d=32):
    torch.manual_seed(0)
    model = MixedStack(d)
    x, y = torch.randn(batch, d), torch.randn(batch, d)
    return model, trace(model, (x,), loss_fn=nn.functional.mse_loss, targets=y)


def test_units_are_every_child_of_the_layer_container():
    _, g = mixed_graph()
    units = pipeline_units(g)
    assert [u.path for u in units] == [f"layers.{i}" for i in range(8)]
    # structurally equal layers stand for each other; the singleton stands for itself
    assert units[3].like == units[4].like and units[5].like == (units[5].start, units[5].stop)


def test_mixed_layers_split_by_their_own_costs():
    _, g = mixed_graph()
    times = [10.0, 10.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0]
    chunks = partition(g, 2, times)
    assert chunks[0].layers == ("layers.0",)            # one wide layer is half the work
    assert chunks[1].layers[-1] == "layers.7"
    assert chunks[0].stop == chunks[1].start and chunks[1].stop == len(g.ops)


def test_estimate_takes_an_explicit_split_and_stage_policies():
    _, g = mixed_graph()
    cluster = Cluster.local(2)
    cfg = ParallelConfig(pp=2, micro_batch_size=1, precision="fp32", chunk_layers=(3, 5),
                         recompute="full", stage_recompute=("full", "none"))
    est = estimate(g, cluster, config=cfg, global_batch_size=4, profile=None)
    assert [len(s.layers) for s in est.stages] == [3, 5]
    assert est.time.recompute_s > 0
    with pytest.raises(Exception, match="add up to"):
        estimate(g, cluster, config=ParallelConfig(pp=2, chunk_layers=(3, 4), precision="fp32"),
                 global_batch_size=4, profile=None)
    with pytest.raises(Exception, match="most memory-saving"):
        ParallelConfig(pp=2, stage_recompute=("full", "none"))


def test_plan_pins_a_split_and_records_per_layer_recompute():
    _, g = mixed_graph()
    p = plan(g, Cluster.local(2), global_batch_size=4, precision="fp32", profile=None,
             force={"pp": 2, "chunk_layers": (3, 5), "stage_recompute": ("full", "none")})
    assert p.config.chunk_layers == (3, 5)
    assert [list(s["layers"]) for s in p.stages] == [[f"layers.{i}" for i in range(3)],
                                               [f"layers.{i}" for i in range(3, 8)]]
    assert {k: v for k, v in p.recompute.items() if k.startswith("layers.")} == {
        **{f"layers.{i}": "full" for i in range(3)},
        **{f"layers.{i}": "none" for i in range(3, 8)}}


def test_estimate_cli_takes_a_split_and_stage_policies(capsys):
    from autoplan.cli.main import main
    args = ["estimate", "gpt-tiny", "--cluster", "local:2", "--global-batch", "8", "--pp", "2",
            "--no-profile", "--precision", "fp32"]
    assert main(args + ["--chunk-layers", "1,1", "--stage-recompute", "full,none"]) == 0
    out = capsys.readouterr().out
    assert "recompute=full/none" in out
    assert main(args + ["--chunk-layers", "1,x"]) == 1
    assert "comma-separated" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["llama-tiny", "hf-t5-tiny", "titan-moe-tiny"])
def test_the_values_crossing_a_cut_are_those_made_before_it_and_read_after(name):
    """``chunk_cost.boundary_values`` (what a stage sends on) against its definition, at every
    cut: the bases of float values an op before the cut makes and one at or after it reads,
    in the order of those reads, each base once."""
    from autoplan.estimate.chunk_cost import boundary_values
    from autoplan.models import build_example
    if name.startswith("hf-"):
        pytest.importorskip("transformers")
    ex = build_example(name, device="meta", batch_size=2)
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    for cut in range(len(graph.ops) + 1):
        made = {n for op in graph.ops[:cut] for n in op.outputs}
        want: list[str] = []
        for op in graph.ops[cut:]:
            for n in op.inputs:
                v = graph.value(n)
                if n in made and v.meta.is_float and v.base not in want:
                    want.append(v.base)
        assert boundary_values(graph, cut) == want, cut
