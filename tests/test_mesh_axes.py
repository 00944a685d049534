"""Mesh axes as a type (``autoplan/sharding/mesh_axes.py``): the rank layout, the groups on any
set of axes and the DeviceMesh built from them agree with the layout formula, with
DeviceMesh's own layout and with each other, over every small mesh.
"""

import itertools
import json
import subprocess
import sys

import pytest
import torch

from autoplan.errors import ConfigError
from autoplan.sharding.mesh_axes import BASE_AXES, CARRIES, Load, MeshAxis, ParallelDims
from autoplan.sharding.parallel_config import ParallelConfig

A = MeshAxis


def _all_dims(max_world: int = 16):
    """Every ParallelDims of at most ``max_world`` ranks with degrees up to 4 (dp up to 8),
    each dp split (none, HSDP, expert parallelism) it allows."""
    for pp, dp, cp, tp in itertools.product((1, 2, 3), (1, 2, 4, 6, 8), (1, 2), (1, 2, 4)):
        if pp * dp * cp * tp > max_world:
            continue
        yield ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp)
        for k in range(2, dp):
            if dp % k == 0:
                yield ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, dp_shard=k)
                yield ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, ep=k)
        if dp > 1:
            yield ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, ep=dp)


DIMS = list(_all_dims())
AXIS_SETS = [s for n in range(0, 4) for s in itertools.combinations(list(MeshAxis), n)]


def _formula_rank(d: ParallelDims, pp: int, dp: int, cp: int, tp: int) -> int:
    return ((pp * d.dp + dp) * d.cp + cp) * d.tp + tp


def test_the_layout_is_the_documented_formula():
    for d in DIMS:
        for r in range(d.world_size):
            c = d.coords(r)
            assert _formula_rank(d, c[A.PP], c[A.DP], c[A.CP], c[A.TP]) == r
            assert d.rank_at({A.PP: c[A.PP], A.DP: c[A.DP], A.CP: c[A.CP], A.TP: c[A.TP]}) == r
            inner = d.dp_shard or d.dp
            assert (c[A.DP_REPLICATE], c[A.DP_SHARD]) == ((c[A.DP] // inner, c[A.DP] % inner)
                                                         if d.dp_shard else (0, c[A.DP]))
            assert (c[A.EDP], c[A.EP]) == divmod(c[A.DP], d.ep) if d.ep > 1 else \
                (c[A.EDP], c[A.EP]) == (c[A.DP], 0)


def test_groups_partition_the_world_on_every_set_of_axes():
    for d in DIMS:
        for axes in AXIS_SETS:
            try:
                groups = d.groups(axes)
            except ValueError:
                continue
            flat = sorted(r for g in groups for r in g)
            assert flat == list(range(d.world_size)), (d, axes)
            n = d.degree(axes)
            for g in groups:
                assert len(g) == n and list(g) == sorted(g)
                for r in g:             # every rank's group is the one it is in
                    assert d.group(axes, r) == g
                    assert [d.index(x, axes) for x in g] == list(range(n))


def test_groups_are_devicemesh_layout_slices():
    """DeviceMesh numbers its ranks ``arange(world).reshape(shape)``: the group of a set of
    mesh axes is a row of that tensor with those axes moved last."""
    for d in DIMS:
        shape = [n for _, n in d.layout]
        names = [a for a, _ in d.layout]
        mesh = torch.arange(d.world_size).reshape(shape)
        for n in range(len(names) + 1):
            for axes in itertools.combinations(names, n):
                rest = [i for i, a in enumerate(names) if a not in axes]
                keep = [names.index(a) for a in axes]
                rows = mesh.permute(rest + keep).reshape(-1, d.degree(axes) if axes else 1)
                assert {tuple(x.tolist()) for x in rows} == set(d.groups(axes)), (d, axes)


def _old_line(cfg, axis, at, start, step, count):
    """The rank formula of ``ParallelConfig._line`` before mesh axes were a type."""
    dims, axes = (cfg.pp, cfg.dp, cfg.cp, cfg.tp), ("pp", "dp", "cp", "tp")
    idx = list(at)
    out = []
    for k in range(count):
        idx[axes.index(axis)] = start + k * step
        rank = 0
        for size, i in zip(dims, idx):
            rank = rank * size + i
        out.append(rank)
    return tuple(out)


def test_config_groups_agree_with_the_old_formulas():
    for d in DIMS:
        if d.ep > 1 and d.cp > 1:
            continue                          # a config refuses ep with cp
        zero = 3 if d.dp_shard else 0
        cfg = ParallelConfig(pp=d.pp, dp=d.dp, cp=d.cp, tp=d.tp, dp_shard=d.dp_shard, ep=d.ep,
                             zero_stage=zero)
        assert cfg.dims == d
        g = ParallelConfig(pp=d.pp, dp=d.dp * d.cp, tp=d.tp, ep=d.ep, zero_stage=zero,
                           dp_shard=None if d.dp_shard is None else d.dp_shard * d.cp)
        s = g.shard_degree
        for p, t in itertools.product(range(d.pp), range(d.tp)):
            assert cfg.dp_group(p, t) == _old_line(g, "dp", (p, 0, 0, t), 0, 1, g.dp)
            for rep in range(g.dp // s):
                assert cfg.dp_shard_group(p, t, rep) == _old_line(g, "dp", (p, 0, 0, t),
                                                                  rep * s, 1, s)
            for sh in range(s):
                assert cfg.dp_replicate_group(p, t, sh) == _old_line(g, "dp", (p, 0, 0, t),
                                                                     sh, s, g.dp // s)
            for rep in range(d.dp // d.ep):
                assert cfg.ep_group(p, t, rep) == _old_line(cfg, "dp", (p, 0, 0, t),
                                                            rep * d.ep, 1, d.ep)
            for e in range(d.ep):
                assert cfg.expert_dp_group(p, t, e) == _old_line(cfg, "dp", (p, 0, 0, t), e,
                                                                 d.ep, d.dp // d.ep)
            for dd, c in itertools.product(range(d.dp), range(d.cp)):
                assert cfg.tp_group(p, dd, c) == _old_line(cfg, "tp", (p, dd, c, 0), 0, 1,
                                                           d.tp)
        for p, dd, t in itertools.product(range(d.pp), range(d.dp), range(d.tp)):
            assert cfg.cp_group(p, dd, t) == _old_line(cfg, "cp", (p, dd, 0, t), 0, 1, d.cp)


def test_mesh_names_and_shapes_as_plan_files_have_them():
    c = ParallelDims
    assert c(dp=4, tp=2).mesh_names() == ("dp", "tp") and c(dp=4, tp=2).mesh_shape() == (4, 2)
    assert c(pp=2, dp=1).mesh_names() == ("pp", "dp", "tp")
    assert c(dp=8, tp=2, dp_shard=4).mesh_names() == ("dp_replicate", "dp_shard", "tp")
    assert c(dp=8, tp=2, dp_shard=4).mesh_shape() == (2, 4, 2)
    assert c(pp=2, dp=4, ep=2).mesh_names() == ("pp", "edp", "ep", "tp")
    assert c(dp=2, cp=2, tp=2).mesh_names() == ("dp", "cp", "tp")
    assert c(dp=4, cp=2, dp_shard=2).flat_name(c(dp=4, cp=2, dp_shard=2).data_axes()) == "dp_cp"
    h = c(dp=4, cp=2, dp_shard=2)
    assert [h.flat_name(x) for x in h.fsdp_axes()] == ["dp_replicate", "dp_shard_cp"]
    e = c(dp=4, ep=2)
    assert e.flat_name(e.data_axes()) == "dp" and e.fsdp_axes() == (e.data_axes(),)
    assert c(pp=2, dp=4, cp=2, tp=2).describe() == "pp2 x dp4 x cp2 x tp2"
    assert c(dp=4, tp=2).describe() == "pp1 x dp4 x tp2"


def test_every_axis_says_what_it_carries():
    assert set(CARRIES) == set(MeshAxis)
    assert A.PP.carries == {Load.STAGES}
    assert Load.EXPERTS in A.EP.carries and Load.SEQUENCE in A.CP.carries
    assert Load.WEIGHT_SPLITS in A.TP.carries
    assert all(Load.BATCH in a.carries for a in MeshAxis if a.value.startswith(("dp", "e")))
    assert [a.value for a in BASE_AXES] == ["pp", "dp", "cp", "tp"]
    assert json.dumps(list(ParallelDims(dp=2).mesh_axes())) == '["dp", "tp"]'


def test_bad_dims_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="dp_shard must divide"):
        ParallelDims(dp=4, dp_shard=3)
    with pytest.raises(ConfigError, match="one way at a time"):
        ParallelDims(dp=8, dp_shard=2, ep=2)
    with pytest.raises(ConfigError, match="ep=3"):
        ParallelDims(dp=4, ep=3)
    with pytest.raises(ValueError, match="overlap"):
        ParallelDims(dp=4, ep=2).rank_at({A.DP: 1, A.EP: 1})


_MESH_SCRIPT = r"""
import json, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from autoplan.sharding.mesh_axes import ParallelDims
out = []
for kw in json.loads(sys.argv[1]):
    d = ParallelDims(**kw)
    for rank in range(d.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=d.world_size)
        mesh = init_device_mesh("cpu", d.mesh_shape(), mesh_dim_names=d.mesh_names())
        got = {a: mesh[a].mesh.flatten().tolist() for a in d.mesh_names()}
        for axes in [d.data_axes()] + list(d.fsdp_axes()):
            if len(axes) > 1:
                name = d.flat_name(axes)
                got[name] = mesh[tuple(a.value for a in axes)]._flatten(name).mesh.tolist()
        out.append([kw, rank, got])
        dist.destroy_process_group()
print(json.dumps(out))
"""


def test_init_device_mesh_makes_the_same_groups():
    """The DeviceMesh the runtime builds (``init_device_mesh`` with ``mesh_shape`` and
    ``mesh_names``, on the ``fake`` backend, every rank of each mesh) holds, on each axis and
    each flattened axis, the group ParallelDims computes."""
    shapes = [dict(pp=2, dp=2, cp=2, tp=2), dict(dp=4, cp=2, dp_shard=2),
              dict(pp=2, dp=4, ep=2, tp=2), dict(dp=8, dp_shard=4), dict(pp=3, dp=2)]
    out = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, json.dumps(shapes)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = 0
    for kw, rank, got in json.loads(out.stdout):
        d = ParallelDims(**kw)
        want = {a.value: list(d.group(a, rank)) for a in d.mesh_axes()}
        for axes in [d.data_axes()] + list(d.fsdp_axes()):
            if len(axes) > 1:
                want[d.flat_name(axes)] = list(d.group(axes, rank))
        assert got == want, (kw, rank)
        seen += 1
    assert seen == sum(ParallelDims(**kw).world_size for kw in shapes)
