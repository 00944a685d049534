"""HSDP (hybrid sharding): the config, its price, the planner's choice and the plan file.

The runtime half (FSDP2 on a 2-D mesh, equal to one device, its collectives counted against the
plan, checkpoints resumed and resharded) is in test_runtime.py, test_pipeline_runtime.py and
test_checkpoint.py.
"""

import json

import pytest

from autoplan import Cluster, ConfigError, ParallelConfig, estimate, plan
from autoplan.errors import PlanError
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.planfile import Plan


@pytest.fixture(scope="module")
def llama8b():
    ex = build_example("llama3-8b", device="meta", batch_size=1)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


def test_config_rules_and_groups():
    c = ParallelConfig(dp=8, tp=2, zero_stage=3, dp_shard=4)
    assert c.shard_degree == 4 and c.short().endswith("zero3 hsdp4x2 bf16")
    assert c.mesh_axes() == ("dp_replicate", "dp_shard", "tp") and c.mesh_shape() == (2, 4, 2)
    # a shard group is consecutive dp ranks (tp innermost), its replicas one group apart
    assert c.dp_shard_group() == (0, 2, 4, 6) and c.dp_shard_group(replica=1) == (8, 10, 12, 14)
    assert c.dp_replicate_group(tp_index=1, shard=3) == (7, 15)
    assert ParallelConfig(dp=8, zero_stage=3).shard_degree == 8
    # every group (built once per mesh and cached) is the ranks the layout formula gives on
    # its axis (tests/test_mesh_axes.py checks every small mesh)
    for cfg in (c, ParallelConfig(pp=2, dp=4, cp=2, tp=2, zero_stage=3, dp_shard=2),
                ParallelConfig(pp=3, dp=4, tp=2, ep=2)):
        def r(*, pp_index, dp_index, tp_index, cp_index=0, cfg=cfg):
            return ((pp_index * cfg.dp + dp_index) * cfg.cp + cp_index) * cfg.tp + tp_index
        for pi in range(cfg.pp):
            for t in range(cfg.tp):
                assert cfg.dp_group(pi, t) == tuple(
                    r(pp_index=pi, dp_index=d, cp_index=k, tp_index=t)
                    for d in range(cfg.dp) for k in range(cfg.cp))
                for d in range(cfg.dp):
                    assert cfg.cp_group(pi, d, t) == tuple(
                        r(pp_index=pi, dp_index=d, cp_index=k, tp_index=t) for k in range(cfg.cp))
                    for k in range(cfg.cp):
                        assert cfg.tp_group(pi, d, k) == tuple(
                            r(pp_index=pi, dp_index=d, cp_index=k, tp_index=x)
                            for x in range(cfg.tp))
                if cfg.cp == 1:
                    shard = cfg.shard_degree
                    assert cfg.dp_shard_group(pi, t, 1 if cfg.dp // shard > 1 else 0) == tuple(
                        r(pp_index=pi, dp_index=(1 if cfg.dp // shard > 1 else 0) * shard + k,
                          tp_index=t) for k in range(shard))
                if cfg.ep > 1:
                    assert cfg.ep_group(pi, t, 1) == tuple(
                        r(pp_index=pi, dp_index=cfg.ep + k, tp_index=t) for k in range(cfg.ep))
                    assert cfg.expert_dp_group(pi, t, 1) == tuple(
                        r(pp_index=pi, dp_index=e * cfg.ep + 1, tp_index=t)
                        for e in range(cfg.dp // cfg.ep))
    assert "dp_shard" not in ParallelConfig(dp=8, zero_stage=3).to_dict()
    assert ParallelConfig.from_dict(c.to_dict()) == c
    for bad, why in ((dict(dp=8, zero_stage=1, dp_shard=4), "zero_stage 2 or 3"),
                     (dict(dp=8, zero_stage=3, dp_shard=3), "divide"),
                     (dict(dp=8, zero_stage=3, dp_shard=8), "strictly between"),
                     (dict(dp=8, zero_stage=3, dp_shard=1), "strictly between")):
        with pytest.raises(ConfigError, match=why):
            ParallelConfig(**bad)


def test_hsdp_holds_more_state_and_reduces_over_its_replicas(llama8b):
    """Model state is sharded over the shard group only; the gradient reduction adds the
    replicas' all-reduce of one shard; the gathers stay inside the group."""
    cluster = Cluster.preset("dgx-h100", nodes=16)
    kw = dict(dp=128, zero_stage=3, micro_batch_size=1, recompute="full")
    fsdp = estimate(llama8b, cluster, config=ParallelConfig(**kw), global_batch_size=128,
                    profile=None)
    hsdp = estimate(llama8b, cluster, config=ParallelConfig(**kw, dp_shard=8),
                    global_batch_size=128, profile=None)
    m_f, m_h = fsdp.stages[0].memory, hsdp.stages[0].memory
    assert m_h.params_bytes == pytest.approx(16 * m_f.params_bytes)
    assert m_h.optimizer_bytes == pytest.approx(16 * m_f.optimizer_bytes)
    assert m_h.activations_bytes == m_f.activations_bytes

    from autoplan.estimate.dp_terms import dp_collectives as _dp_collectives
    p, layers = 8e9, 32
    _, ag_f, rs_f = _dp_collectives(ParallelConfig(**kw), cluster, p, layers, 0)
    _, ag_h, rs_h = _dp_collectives(ParallelConfig(**kw, dp_shard=8), cluster, p, layers, 0)
    node = tuple(range(8))
    assert ag_h == pytest.approx(cluster.collective_time_s("all_gather", p * 2 / layers, node))
    replicas = tuple(range(0, 128, 8))
    assert rs_h == pytest.approx(
        cluster.collective_time_s("reduce_scatter", p * 4 / layers, node)
        + cluster.collective_time_s("all_reduce", p * 4 / layers / 8, replicas))
    assert ag_h < ag_f                      # one node's ring, not 128 ranks'


def test_the_planner_chooses_hsdp_at_scale_and_writes_its_axes(llama8b, tmp_path):
    """Llama-3-8B on 512 H100: sharding over all 512 ranks pays a 512-step ring per gather;
    the plan shards over whole nodes and replicates across them, and says so in its mesh."""
    p = plan(llama8b, Cluster.preset("dgx-h100", nodes=64), global_batch_size=512,
             profile=None)
    cfg = p.config
    assert cfg.dp_shard is not None and cfg.zero_stage in (2, 3), cfg.short()
    assert cfg.dp_shard % 8 == 0                       # whole nodes
    assert p.mesh.axes == ("dp_replicate", "dp_shard", "tp")
    assert p.mesh.shape == (cfg.dp // cfg.dp_shard, cfg.dp_shard, 1)
    plain = [a for a in p.alternatives if a.config.zero_stage == cfg.zero_stage
             and a.config.dp_shard is None and a.config.dp == cfg.dp]
    assert plain and all(a.step_time_s >= p.predicted["step_time_s"] for a in plain)
    path = tmp_path / "plan.json"
    p.save(path)
    assert Plan.from_json(path.read_text()).config == cfg
    # a mesh that does not say how dp is split is refused, naming what it should be
    d = json.loads(path.read_text())
    d["mesh"]["axes"] = ["dp", "tp"]
    d["mesh"]["shape"] = [cfg.dp, 1]
    with pytest.raises(PlanError, match="dp_replicate and dp_shard"):
        Plan.from_json(json.dumps(d))


def test_a_forced_shard_group_is_honoured_or_refused(llama8b):
    cluster = Cluster.preset("dgx-h100", nodes=8)
    p = plan(llama8b, cluster, global_batch_size=64, profile=None,
             force={"dp_shard": 16, "zero_stage": 3, "tp": 1})
    assert p.config.dp_shard == 16 and p.config.dp == 64
    with pytest.raises(ConfigError, match="dp_shard"):
        plan(llama8b, cluster, global_batch_size=64, profile=None,
             force={"dp_shard": 16, "zero_stage": 1})
