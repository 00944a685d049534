"""Heterogeneous clusters (issue 40 item 1, the planning half): pools parse from a preset string
and from files, bad specs say what to do, a cluster of one pool is that cluster, identical pools
price as the homogeneous cluster, and the balanced split equals the brute-force best."""

import itertools
import random
from dataclasses import replace

import pytest

from autoplan import Cluster, estimate, plan
from autoplan.cli.main import main
from autoplan.errors import ClusterError, ConfigError
from autoplan.estimate.hetero import estimate_hetero
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.hetero import balance, min_max_split, plan_hetero
from autoplan.sharding.parallel_config import ParallelConfig

MIXED = "dgx-a100-80gb/1:2+dgx-h100/1:2"      # 4 ranks: two A100 nodes, then two H100 nodes


@pytest.fixture(scope="module")
def graph():
    """Big enough layers (GPT-3 1.3B's, six of them) that the device, not launch, sets times."""
    ex = build_example("gpt3-1.3b", device="meta", batch_size=1, num_layers=6)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                 name="gpt3-1.3b-6")


@pytest.fixture(scope="module")
def tiny():
    ex = build_example("gpt-tiny", device="meta", batch_size=1, num_layers=4)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                 name="gpt-tiny")


def test_preset_string_makes_pools_in_rank_order():
    c = Cluster.from_spec("dgx-a100-80gb:4+dgx-h100:4")
    assert c.world_size == 64 and len(c.pools) == 2
    assert [p.first_rank for p in c.pools] == [0, 32]
    assert c.device_of(31).name.startswith("A100") and c.device_of(32).name.startswith("H100")
    assert (c.pool_of(0), c.pool_of(31), c.pool_of(32), c.pool_of(63)) == (0, 0, 1, 1)
    # the object's own description is the slowest pool's node type over all 8 nodes
    assert c.device.name.startswith("A100") and c.num_nodes == 8
    # a group inside the H100 pool runs on its NVLink, one crossing pools at the slower NICs
    h100 = Cluster.preset("dgx-h100", 4)
    assert c.group_bandwidth_bytes_per_s(range(32, 40)) == h100.group_bandwidth_bytes_per_s(
        range(8))
    cross = c.group_bandwidth_bytes_per_s([0, 8, 32, 40])
    assert cross == c.group_bandwidth_bytes_per_s([0, 8, 16, 24]) < \
        c.group_bandwidth_bytes_per_s([32, 40, 48, 56])
    text = c.describe()
    assert "pool 0: dgx-a100-80gb:4" in text and "ranks 32-63" in text and "(slowest)" in text
    assert "H100" in c.hardware().device and "A100" in c.hardware().device


def test_cluster_file_with_pools_reads_back(tmp_path):
    f = tmp_path / "mixed.yaml"
    f.write_text("name: mixed\npools:\n  - {preset: dgx-a100-80gb, num_nodes: 2}\n"
                 "  - {preset: dgx-h100, num_nodes: 1}\n")
    c = Cluster.from_file(f)
    assert c.name == "mixed" and c.world_size == 24
    assert [p.num_ranks for p in c.pools] == [16, 8]
    again = Cluster.from_dict(c.to_dict())
    assert again == c and again.pools[1].device == c.pools[1].device
    assert c != Cluster.from_spec("dgx-a100-80gb:2+dgx-h100:2")


BAD_SPECS = [
    ("dgx-h100:4+", "empty part"),
    ("+dgx-h100:4", "empty part"),
    ("dgx-h100:x+dgx-a100-80gb:1", "whole number"),
    ("dgx-h100:1+nope:2", "neither a file nor a preset"),
    ("local:2+dgx-h100:1", "cannot be a pool"),
    ("dgx-h100:1+dgx-a100-80gb/2:1", "devices per node"),
]


@pytest.mark.parametrize("spec,said", BAD_SPECS)
def test_bad_pool_specs_say_what_to_do(spec, said):
    with pytest.raises(ClusterError, match=said) as e:
        Cluster.from_spec(spec)
    assert any(w in str(e.value) for w in ("write", "use", "join", "must", "presets", "plan",
                                           "describe"))


@pytest.mark.parametrize("body,said", [
    ("pools: dgx-h100\n", "non-empty list"),
    ("pools: []\n", "non-empty list"),
    ("pools: [dgx-h100]\n", r"pools\[0\] must be a mapping"),
    ("pools: [{preset: dgx-h100}]\ndevice: h100-sxm5-80gb\n", "only these keys"),
    ("pools: [{preset: dgx-h100}, {preset: nope}]\n", "unknown cluster preset"),
])
def test_bad_pool_files_say_what_to_do(tmp_path, body, said):
    f = tmp_path / "bad.yaml"
    f.write_text(body)
    with pytest.raises(ClusterError, match=said):
        Cluster.from_file(f)


def test_fuzzed_specs_give_a_cluster_or_a_cluster_error():
    rng = random.Random(40)
    parts = ["dgx-h100", "dgx-a100-80gb", "dgx-h100/2", "local", "x", "", ":", "2", "0", "-1",
             "+", "dgx-h100:1", ":3", "/", "dgx-a100-80gb:1"]
    for _ in range(200):
        spec = "".join(rng.choice(parts) for _ in range(rng.randint(1, 5)))
        if "local" in spec and "+" not in spec:
            continue                                  # the local machine: not what is fuzzed
        try:
            c = Cluster.from_spec(spec)
        except ClusterError as e:
            assert str(e)
        else:
            assert c.world_size >= 1


def test_one_pool_is_that_cluster(tiny):
    """A homogeneous cluster written as one pool is that cluster, and plans identically."""
    one = Cluster.from_dict({"name": "dgx-h100", "pools": [{"preset": "dgx-h100", "num_nodes": 1}]})
    plain = Cluster.preset("dgx-h100", 1)
    assert one == plain and not one.pools
    a = plan(tiny, one, global_batch_size=16, profile=None)
    b = plan(tiny, plain, global_batch_size=16, profile=None)
    assert a.config == b.config and a.predicted == b.predicted


@pytest.mark.parametrize("config", [
    ParallelConfig(dp=1, tp=1, pp=4, micro_batch_size=1),
    ParallelConfig(dp=2, tp=1, pp=2, micro_batch_size=2, zero_stage=1),
    ParallelConfig(dp=4, tp=1, pp=1, micro_batch_size=1),
    ParallelConfig(dp=2, tp=2, pp=1, micro_batch_size=1, zero_stage=3),
])
def test_identical_pools_price_as_the_homogeneous_cluster(graph, config):
    """Two pools of one node type: every term priced per pool must come out as on the
    homogeneous cluster (the composition adds nothing of its own)."""
    plain = Cluster.preset("dgx-h100/2", 2)
    node = Cluster.preset("dgx-h100/2", 1)
    pools = Cluster.heterogeneous([node, node], name="two pools", merge=False)
    assert len(pools.pools) == 2
    # written as a spec, pools of one node type are that homogeneous cluster
    assert Cluster.from_spec("dgx-h100/2:1+dgx-h100/2:1").fingerprint() == Cluster.from_dict(
        {**plain.to_dict(), "name": "dgx-h100/2:1+dgx-h100/2:1"}).fingerprint()
    het = estimate_hetero(graph, pools, config=config, global_batch_size=16, profile=None)
    ref = estimate(graph, plain, config=config, global_batch_size=16, profile=None)
    assert het.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9)
    assert het.estimate.peak_memory_bytes == pytest.approx(ref.peak_memory_bytes, rel=1e-9)


def _compositions(total, parts):
    for cut in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cut, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def test_stage_split_equals_brute_force(graph):
    """6 layers over 4 stages (A100, A100, H100, H100): all 10 splits priced; the search's
    split is the best of them, and faster than the even one."""
    cluster = Cluster.from_spec(MIXED)
    config = ParallelConfig(dp=1, tp=1, pp=4, micro_batch_size=1)
    steps = {s: estimate_hetero(graph, cluster, config=replace(config, chunk_layers=s),
                                global_batch_size=8, profile=None).step_time_s
             for s in _compositions(6, 4)}
    found = balance(graph, cluster, config, 8, profile=None)
    assert found.balanced.step_time_s == pytest.approx(min(steps.values()), rel=1e-12)
    assert found.balanced.step_time_s < found.even_step_s
    assert sum(found.config.chunk_layers[2:]) > sum(found.config.chunk_layers[:2])


def test_dp_shares_equal_brute_force(graph):
    """12 micro-batches over 4 replicas (two on A100, two on H100): all 165 splits priced."""
    cluster = Cluster.from_spec(MIXED)
    config = ParallelConfig(dp=4, tp=1, pp=1, micro_batch_size=1)
    steps = {s: estimate_hetero(graph, cluster, config=config, global_batch_size=12,
                                dp_shares=s, profile=None).step_time_s
             for s in _compositions(12, 4)}
    found = balance(graph, cluster, config, 12, profile=None)
    assert found.balanced.step_time_s == pytest.approx(min(steps.values()), rel=1e-12)
    shares = found.balanced.dp_shares
    assert sum(shares) == 12 and min(shares[2:]) > max(shares[:2])


def test_configs_straddling_pools_are_refused(graph):
    cluster = Cluster.from_spec(MIXED)
    with pytest.raises(ConfigError, match="straddle"):
        estimate_hetero(graph, cluster, config=ParallelConfig(dp=1, tp=4, pp=1), global_batch_size=4,
                        profile=None)
    with pytest.raises(ConfigError, match="straddle"):
        estimate_hetero(graph, Cluster.from_spec("dgx-a100-80gb/1:1+dgx-h100/1:3"),
                        config=ParallelConfig(dp=2, tp=1, pp=2), global_batch_size=4, profile=None)
    with pytest.raises(ConfigError, match="sum"):
        estimate_hetero(graph, cluster, config=ParallelConfig(dp=4, tp=1, pp=1),
                        global_batch_size=12, dp_shares=(1, 1, 1, 1), profile=None)


def test_min_max_split_is_exact():
    for t in ([1.0, 1.0], [1.0, 3.0], [2.0, 1.0, 0.5], [0.3, 0.3, 1.0, 1.0]):
        for total in range(len(t), 14):
            best = min(max(n * x for n, x in zip(s, t)) for s in _compositions(total, len(t)))
            got = min_max_split(total, t)
            assert sum(got) == total and max(n * x for n, x in zip(got, t)) == best


def test_plan_hetero_beats_the_slowest_gpu(graph):
    cluster = Cluster.from_spec(MIXED)
    result = plan_hetero(graph, cluster, global_batch_size=16, profile=None)
    assert result.baseline.cluster.name.endswith("as slowest")
    assert result.step_time_s < result.baseline_step_s and result.speedup > 1.2
    assert result.best.balanced.estimate.fits
    assert "gain" in "\n".join(result.summary_lines())


def test_cli_estimate_shows_the_gain(capsys):
    assert main(["estimate", "gpt-tiny", "--cluster", MIXED, "--global-batch", "12",
                 "--dp", "4", "--dp-shares", "2,2,4,4"]) == 0
    out = capsys.readouterr().out
    assert "micro-batches per replica [2 x2, 4 x2]" in out and "as its slowest GPU" in out
    assert main(["cluster", "show", MIXED]) == 0
    assert "pool 1: dgx-h100/1:2" in capsys.readouterr().out


def test_cli_plan_on_pools_writes_a_plan_file(tmp_path, capsys):
    import json
    # GPT-3 1.3B's layers: at gpt-tiny's shapes the H100's measured matmul efficiency per
    # shape makes it slower than the A100's flat 70 % of peak, and the pools could not gain
    out = tmp_path / "tiny.plan.json"
    assert main(["plan", "gpt3-1.3b", "--layers", "2", "--cluster", MIXED, "--global-batch", "16",
                 "--no-profile", "--quiet", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "The cluster as its slowest GPU" in text and "Heterogeneous plan" in text
    written = json.loads(out.read_text())        # a runnable plan (tests/test_hetero_run.py)
    assert written["cluster"]["name"] == MIXED and written["schema_version"] == 9
    assert written["predicted"]["step_time_s"] <= written["hetero"]["slowest_gpu"]["step_time_s"]


def test_estimate_and_plan_refuse_pools_rather_than_price_them_as_one_device(graph):
    """``autoplan.estimate`` and ``autoplan.plan`` on pools would price every rank as the
    slowest pool's device: they refuse and name estimate_hetero / plan_hetero."""
    cluster = Cluster.from_spec(MIXED)
    config = ParallelConfig(dp=1, tp=1, pp=4, micro_batch_size=1, chunk_layers=(1, 1, 2, 2))
    with pytest.raises(ConfigError, match="estimate_hetero"):
        estimate(graph, cluster, config=config, global_batch_size=8, profile=None)
    het = estimate_hetero(graph, cluster, config=config, global_batch_size=8, profile=None)
    assert het.step_time_s < estimate(graph, cluster.slowest(), config=config,
                                      global_batch_size=8, profile=None).step_time_s
    with pytest.raises(ConfigError, match="plan_hetero"):
        plan(graph, cluster, global_batch_size=8, profile=None)


def test_mixed_nics_are_pools_and_crossing_groups_take_the_slower():
    c = Cluster.from_dict({"name": "nics", "pools": [
        {"preset": "dgx-h100", "num_nodes": 2, "fabric": {"link": "ib-hdr"}},
        {"preset": "dgx-h100", "num_nodes": 2}]})
    assert [p.cluster.fabric.link for p in c.pools] == ["ib-hdr", "ib-ndr"]
    hdr, ndr = c.group_bandwidth_bytes_per_s([0, 8]), c.group_bandwidth_bytes_per_s([16, 24])
    assert hdr < ndr and c.group_bandwidth_bytes_per_s([8, 16]) == hdr
    assert c.p2p_time_s(1e9, 8, 16) == c.p2p_time_s(1e9, 0, 8) > c.p2p_time_s(1e9, 16, 24)


def test_shares_on_pools_hold_fsdp_state_whole(graph):
    """On pools, a replica of two micro-batches or more under ZeRO-3 holds its bf16 weights and
    fp32 gradients unsharded for the step (``runtime/steps.fsdp_once_a_step``), as on one
    device type: the peak over the even split's grows by that, less the two-layer gather
    buffer it no longer needs."""
    cluster = Cluster.from_spec(MIXED)
    config = ParallelConfig(dp=4, tp=1, pp=1, micro_batch_size=1, zero_stage=3)
    even = estimate_hetero(graph, cluster, config=config, global_batch_size=12, profile=None)
    uneven = estimate_hetero(graph, cluster, config=config, global_batch_size=12,
                             dp_shares=(2, 2, 4, 4), profile=None)
    params = even.estimate.stages[0].params_per_device
    # (less the root unit, the weights outside the layers, gathered in fp32 through the even
    # split's forward and backward: counted whole in bf16 with the rest under the shares)
    outside = sum(v.meta.numel for v in graph.params if "layers." not in v.fqn)
    held = params * (2 + 4 * 3 / 4) - 2 * params / 6 * 2 * 2 - outside * 2
    assert uneven.estimate.peak_memory_bytes - even.estimate.peak_memory_bytes == \
        pytest.approx(held)
    assert uneven.estimate.config.dp_shares == (2, 2, 4, 4)


def test_climb_prices_each_split_once_and_finds_the_least():
    """The hill-climb over splits on a toy pure price (the largest bin's n x t): the least of
    every split of 9 over 3, each split priced at most once (a round revisits its last move's
    reverse)."""
    from types import SimpleNamespace
    from autoplan.planner.hetero import _climb
    t = (3.0, 1.0, 2.0)
    calls: list[tuple[int, ...]] = []

    def price(split):
        calls.append(split)
        return SimpleNamespace(step_time_s=max(n * s for n, s in zip(split, t)),
                               estimate=SimpleNamespace(fits=True))
    got = _climb((7, 1, 1), price, minimum=1)
    least = min(max(n * s for n, s in zip(split, t)) for split in _compositions(9, 3))
    assert got.step_time_s == least
    assert len(calls) == len(set(calls)) and len(calls) > 3
