"""Heterogeneous clusters beyond step time (issue 40 items 1, 2, 4 on pools): the objectives
choose which pools and nodes to use (the cheapest plan meeting a deadline checked by brute force
over every candidate), energy per pool composes to the homogeneous figure, the data's length
distribution is priced per pool, and each stage's optimizer step runs on its own device."""

import json
from dataclasses import replace

import pytest

from autoplan import Cluster, estimate
from autoplan.cli.main import main
from autoplan.cluster.economics import economics
from autoplan.errors import ConfigError
from autoplan.estimate.energy import hetero_step_energy, step_energy
from autoplan.estimate.hetero import estimate_hetero
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.hetero import plan_hetero
from autoplan.planner.objectives_pools import plan_pools, subsets
from autoplan.planner.search import plan
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.sharding.seq_lengths import histogram_of

MIXED = "dgx-a100-80gb/1:2+dgx-h100/1:2"      # 4 ranks: two A100 nodes, then two H100 nodes
TOKENS = 10 ** 9


@pytest.fixture(scope="module")
def graph():
    """GPT-3 1.3B's layers (two of them): big enough that the device, not launch, sets times."""
    ex = build_example("gpt3-1.3b", device="meta", batch_size=1, num_layers=2)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                 name="gpt3-1.3b-2")


def test_subsets_are_each_pool_by_counts_then_the_pools_together():
    c = Cluster.from_spec("dgx-a100-80gb:4+dgx-h100:4")
    labels = [(s.label, s.gpus, s.pools) for s in subsets(c, None)]
    assert labels[:6] == [("dgx-a100-80gb/1", 1, (0,)), ("dgx-a100-80gb/2", 2, (0,)),
                          ("dgx-a100-80gb/4", 4, (0,)), ("dgx-a100-80gb:1", 8, (0,)),
                          ("dgx-a100-80gb:2", 16, (0,)), ("dgx-a100-80gb:4", 32, (0,))]
    assert labels[-1] == ("dgx-a100-80gb:4+dgx-h100:4", 64, (0, 1)) and len(labels) == 13
    assert max(s.gpus for s in subsets(c, 40)) == 32     # both pools (64) over --max-gpus


@pytest.fixture(scope="module")
def brute(graph):
    """Every candidate the search considers, each planned for step time, with every plan kept
    there (a pool alone: the chosen plan and its fitting alternatives; the pools together:
    every balanced candidate): (label, run time, cost), cost from the list prices by hand."""
    cluster = Cluster.from_spec(MIXED)
    price = [economics(p.cluster).usd_per_gpu_hour for p in cluster.pools]
    out = []
    for sub in subsets(cluster, None):
        if len(sub.pools) == 1:
            p = plan(graph, sub.cluster, global_batch_size=16, profile=None)
            tokens_per_step = p.predicted["tokens_per_s"] * p.predicted["step_time_s"]
            steps = [p.predicted["step_time_s"]] + [a.step_time_s for a in p.alternatives
                                                    if a.fits]
            usd_per_s = sub.gpus * price[sub.pools[0]] / 3600
        else:
            h = plan_hetero(graph, sub.cluster, global_batch_size=16, profile=None)
            est = h.best.balanced.estimate
            tokens_per_step = est.tokens_per_s * est.step_time_s
            steps = [c.balanced.step_time_s for c in h.candidates if c.balanced.estimate.fits]
            usd_per_s = sum(p.num_ranks * price[i] for i, p in enumerate(cluster.pools)) / 3600
        for step_s in steps:
            run_s = TOKENS / tokens_per_step * step_s
            out.append((sub.label, run_s, usd_per_s * run_s))
    return cluster, out


def test_the_cheapest_plan_meeting_a_deadline_on_pools_is_found(graph, brute):
    cluster, rows = brute
    labels = list(dict.fromkeys(lab for lab, _, _ in rows))
    assert labels[-1] == "dgx-a100-80gb/1:2+dgx-h100/1:2" and len(labels) == 5
    fastest = sorted(min(r for lab, r, _ in rows if lab == x) for x in labels)
    # a deadline that the cheapest candidates miss and the faster ones meet
    deadline_days = (fastest[1] + fastest[2]) / 2 / 86_400
    want_cost, want_label = min((c, lab) for lab, r, c in rows if r <= deadline_days * 86_400)
    assert want_cost > min(c for _, _, c in rows)         # the deadline binds
    got = plan_pools(graph, cluster, global_batch_size=16, profile=None, objective="cost",
                     tokens=TOKENS, deadline_days=deadline_days)
    sec = got.objectives
    assert got.best.devices == want_label == sec["chosen_devices"]
    assert got.best.cost_usd == pytest.approx(want_cost, rel=1e-6)
    assert sum(1 for p in sec["points"] if p["excluded"]) == 3
    assert {p["devices"] for p in sec["points"]} == set(labels)
    # the time winner is the brute force's fastest
    assert sec["winner_devices"]["time"] == min(rows, key=lambda r: r[1])[0]
    # the section reads back (closed keys, the chosen point among the points)
    from autoplan.planner.objectives_check import check_objectives
    check_objectives(json.loads(json.dumps(sec)), sec["chosen_gpus"])
    bad = {**sec, "chosen_devices": "dgx-h100/1:7"}
    with pytest.raises(Exception, match="chosen_gpus"):
        check_objectives(bad, sec["chosen_gpus"])


@pytest.mark.parametrize("config", [
    ParallelConfig(dp=2, tp=1, pp=2, micro_batch_size=1),
    ParallelConfig(dp=4, tp=1, pp=1, micro_batch_size=1),
])
def test_energy_on_identical_pools_is_the_homogeneous_energy(graph, config):
    plain = Cluster.preset("dgx-h100/2", 2)
    node = Cluster.preset("dgx-h100/2", 1)
    pools = Cluster.heterogeneous([node, node], name="two pools", merge=False)
    econ = economics(node)
    het = estimate_hetero(graph, pools, config=config, global_batch_size=16, profile=None)
    ref = estimate(graph, plain, config=config, global_batch_size=16, profile=None)
    got, want = hetero_step_energy(het, [econ, econ]), step_energy(ref.to_dict(), 4, econ)
    assert got.total_joules == pytest.approx(want.total_joules, rel=1e-9)
    assert got.idle_device_s == pytest.approx(want.idle_device_s, rel=1e-9, abs=1e-12)


def test_energy_on_pools_draws_each_devices_own_power(graph):
    """Replicas on A100 and H100 with even shares: each device at its own TDP; the H100
    replicas finish first and idle until the A100's step ends."""
    cluster = Cluster.from_spec(MIXED)
    config = ParallelConfig(dp=4, tp=1, pp=1, micro_batch_size=1)
    het = estimate_hetero(graph, cluster, config=config, global_batch_size=8, profile=None)
    a100, h100 = (economics(p.cluster) for p in cluster.pools)
    e = hetero_step_energy(het, [a100, h100])
    units = het.unit_estimates
    assert len(units) == 4 and units[3].step_time_s < units[0].step_time_s == het.step_time_s
    per = [step_energy({**u.to_dict(), "step_time_s": het.step_time_s}, 1, x)
           for u, x in zip(units, [a100, a100, h100, h100])]
    assert e.total_joules == pytest.approx(sum(p.total_joules for p in per), rel=1e-12)
    assert per[3].idle_device_s > per[0].idle_device_s
    # priced at the A100's power alone, the H100 replicas would draw less
    assert e.total_joules > hetero_step_energy(het, [a100, a100]).total_joules


def test_each_stage_prices_its_optimizer_step_on_its_own_device(graph):
    """The H100 stage first, the A100 stage last: the A100 stage's optimizer step (its HBM is
    slower) is priced on the A100, where the first stage's device priced every stage before."""
    cfg = ParallelConfig(dp=1, tp=1, pp=2, micro_batch_size=1)
    fast_first = Cluster.from_spec("dgx-h100/1:1+dgx-a100-80gb/1:1")
    het = estimate_hetero(graph, fast_first, config=cfg, global_batch_size=4, profile=None)
    h100 = estimate(graph, Cluster.preset("dgx-h100/1", 2), config=cfg, global_batch_size=4,
                    profile=None)
    a100 = estimate(graph, Cluster.preset("dgx-a100-80gb/1", 2), config=cfg,
                    global_batch_size=4, profile=None)
    opt = het.estimate.time.optimizer_s
    assert h100.time.optimizer_s < opt <= a100.time.optimizer_s
    # the A100 first: its stage 0 (the embeddings: the most parameters) is the worst on
    # either cluster, and priced alike
    slow_first = Cluster.from_spec("dgx-a100-80gb/1:1+dgx-h100/1:1")
    again = estimate_hetero(graph, slow_first, config=cfg, global_batch_size=4, profile=None)
    assert again.estimate.time.optimizer_s == pytest.approx(a100.time.optimizer_s, rel=1e-12)


def test_seq_lengths_are_priced_per_pool(tmp_path):
    """Packed documents: on identical pools the step is the homogeneous one under the same
    lengths; on mixed pools the plan prices the masked work (shorter documents, less
    attention) and the command line takes --seq-lengths."""
    ex = build_example("llama-tiny", batch_size=1, seq_len=2048, device="meta",
                       hidden_size=512, num_heads=8, num_kv_heads=8)
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    docs = histogram_of([(64, 30), (2048, 1)])
    cfg = ParallelConfig(dp=2, tp=1, pp=2, micro_batch_size=1)
    node = Cluster.preset("dgx-h100/2", 1)
    pools = Cluster.heterogeneous([node, node], name="two pools", merge=False)
    het = estimate_hetero(graph, pools, config=cfg, global_batch_size=8, profile=None,
                          seq_lengths=docs)
    ref = estimate(graph, Cluster.preset("dgx-h100/2", 2), config=cfg, global_batch_size=8,
                   profile=None, seq_lengths=docs)
    assert het.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9)
    mixed = Cluster.from_spec(MIXED)
    fixed = estimate_hetero(graph, mixed, config=cfg, global_batch_size=8, profile=None)
    packed = estimate_hetero(graph, mixed, config=cfg, global_batch_size=8, profile=None,
                             seq_lengths=docs)
    assert packed.step_time_s < fixed.step_time_s
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("64 30\n2048 1\n")
    out = tmp_path / "p.json"
    assert main(["plan", "llama-tiny", "--seq-len", "2048", "--cluster", MIXED,
                 "--global-batch", "8", "--no-profile", "-q", "--seq-lengths", str(lengths),
                 "-o", str(out)]) == 0
    written = json.loads(out.read_text())      # a runnable plan file (rounded to 6 digits)
    assert (written["predicted"]["step_time_s"]
            <= written["hetero"]["slowest_gpu"]["step_time_s"] * (1 + 1e-5))


def test_plan_hetero_points_objectives_to_plan_pools(graph):
    with pytest.raises(ConfigError, match="plan_pools"):
        plan_hetero(graph, Cluster.from_spec(MIXED), global_batch_size=16, profile=None,
                    objective="cost")
    with pytest.raises(ConfigError, match="plan_pools\\(\\) plans heterogeneous"):
        plan_pools(graph, Cluster.preset("dgx-h100", 1), global_batch_size=16, objective="cost")


def test_plan_command_on_pools_prints_the_front(tmp_path, capsys):
    out = tmp_path / "p.json"
    # batch 64: enough work that the pools together are fastest (at 16 two H100s alone win)
    assert main(["plan", "gpt3-1.3b", "--layers", "2", "--cluster", MIXED, "--global-batch",
                 "64", "--no-profile", "-q", "--objective", "time", "--tokens", "1e9",
                 "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "objectives: time" in text and "dgx-a100-80gb/1:2+dgx-h100/1:2:" in text
    assert "A100-SXM4-80GB: $" in text and "H100-SXM5-80GB: $" in text
    written = json.loads(out.read_text())     # the winner over both pools: a runnable plan
    assert written["objectives"]["chosen_devices"] == MIXED and written["hetero"]
    assert main(["inspect", str(out)]) == 0
    pytest.importorskip("matplotlib")
    assert (tmp_path / "p.pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mixed_nics_pools_are_priced_alike(graph):
    """Two pools of one device type that differ only in NICs: one price per device, so the
    pools together cost what their GPUs cost."""
    c = Cluster.from_dict({"name": "nics", "pools": [
        {"preset": "dgx-h100/1", "num_nodes": 1, "fabric": {"link": "ib-hdr"}},
        {"preset": "dgx-h100/1", "num_nodes": 1}]})
    got = plan_pools(graph, c, global_batch_size=16, profile=None, objective="cost",
                     tokens=TOKENS)
    both = next(p for p in got.points if "+" in p.devices)
    price = economics(c.pools[0].cluster).usd_per_gpu_hour
    assert both.cost_usd == pytest.approx(2 * price * both.run_time_s / 3600, rel=1e-12)
    assert replace(both, excluded="").gpus == 2
