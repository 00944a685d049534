"""`autoplan cluster show --png` and `autoplan inspect --topology`: the mesh axes on the
topology. The groups listed per axis are the plan's mesh groups (checked against the plan
file's own mesh coordinates), the links they cross are the ones their paths take (NVSwitch
inside a DGX, the InfiniBand fabric across nodes, the spines across leaves, the socket link
on a PCIe box), the bandwidth is the one the cost model prices, and the pictures are real
images with something drawn on them."""

from pathlib import Path

import pytest

from autoplan.cli.main import main
from autoplan.cluster import Cluster
from autoplan.cluster.topology_view import (axis_groups_text, fmt_ranks, group_bandwidth,
                                            mesh_axis_groups, shown_nodes)
from autoplan.planner.planfile import plan_from_file
from autoplan.sharding.mesh_axes import ParallelDims

GOLDEN = Path(__file__).parent / "golden"
PLANS = ["titan-moe-pp2-h100x16", "mixtral-ep2-a100x8", "llama-tiny-cp2-h100x16"]
# a plan file's mesh axis -> the axis named in the picture (dp spans its sub-axes)
SPANS = {"tp": {"tp"}, "cp": {"cp"}, "pp": {"pp"}, "ep": {"ep"},
         "dp": {"dp", "edp", "ep", "dp_replicate", "dp_shard"}}


def _by_coordinates(mesh, axes: set[str]) -> tuple[int, ...]:
    """The ranks whose mesh coordinates differ from rank 0's only on ``axes``."""
    zero = mesh.coordinates(0)
    keep = [i for i, a in enumerate(mesh.axes) if a not in axes]
    return tuple(r for r in range(len(mesh.rank_to_device))
                 if all(mesh.coordinates(r)[i] == zero[i] for i in keep))


@pytest.mark.parametrize("name", PLANS)
def test_each_axis_lists_rank_zeros_group_of_the_plans_mesh(name):
    p = plan_from_file(GOLDEN / f"{name}.plan.json")
    cluster = Cluster.from_spec(f"{p.cluster.name}:{p.cluster.num_nodes}")
    groups = mesh_axis_groups(cluster, p.config.dims)
    named = {a for a, n in zip(p.mesh.axes, p.mesh.shape) if n > 1}
    assert {g.axis for g in groups} == {a for a in SPANS if SPANS[a] & named}
    text = axis_groups_text(cluster, groups)
    per = cluster.devices_per_node
    for g in groups:
        assert g.example == _by_coordinates(p.mesh, SPANS[g.axis]), g.axis
        assert g.size == len(g.example) and g.size * g.num_groups == cluster.world_size
        assert g.nodes == tuple(sorted({r // per for r in g.example}))
        assert f"rank 0's: {fmt_ranks(g.example)}" in text
        assert g.bandwidth_bytes_per_s == group_bandwidth(cluster, g.example, g.pattern)


def test_the_links_each_axis_crosses():
    """tp8 inside a DGX H100 crosses NVLink only; dp across two nodes of a leaf crosses PCIe to
    the NIC and InfiniBand, no spine; pp over 16 nodes spans two leaves and crosses a spine;
    cp across the sockets of a PCIe box crosses their link."""
    c = Cluster.from_spec("dgx-h100:16")
    tp, dp, pp = mesh_axis_groups(c, ParallelDims.of(pp=8, dp=2, tp=8))
    assert (tp.example, dp.example) == (tuple(range(8)), (0, 8))
    assert pp.example == tuple(range(0, 128, 16)) and pp.nodes == tuple(range(0, 16, 2))
    assert {u.link for u in tp.links} == {"nvlink4"}
    assert tp.links[0].lanes == 18 and tp.links[0].bandwidth_bytes_per_s == 18 * 25e9
    assert {(u.link, u.joins) for u in dp.links} == {
        ("pcie5-x16", "GPU-PCIe switch"), ("pcie5-x16", "PCIe switch-NIC"),
        ("ib-ndr", "NIC-leaf switch")}
    assert ("ib-ndr", "leaf switch-spine switch") in {(u.link, u.joins) for u in pp.links}
    assert tp.bandwidth_bytes_per_s == c.group_bandwidth_bytes_per_s(tp.example)
    assert pp.bandwidth_bytes_per_s == c.p2p_bandwidth_bytes_per_s(0, 16)
    assert dp.bandwidth_bytes_per_s < tp.bandwidth_bytes_per_s / 5
    pcie = Cluster.from_spec("pcie-8gpu")
    tp4, cp2 = mesh_axis_groups(pcie, ParallelDims.of(cp=2, tp=4))
    assert {u.link for u in tp4.links} == {"pcie4-x16"}
    assert "upi" in {u.link for u in cp2.links}
    assert cp2.bandwidth_bytes_per_s < tp4.bandwidth_bytes_per_s


def test_large_clusters_keep_a_few_nodes():
    assert shown_nodes(4) == (0, 1, 2, 3)
    assert shown_nodes(128) == (0, 1, 127)
    c = Cluster.from_spec("dgx-h100:16")
    groups = mesh_axis_groups(c, ParallelDims.of(pp=8, dp=2, tp=8))
    assert shown_nodes(16, groups) == (0, 1, 2)          # dp's second node, pp's second


def _check_image(path: Path, min_size: tuple[int, int]) -> None:
    image = pytest.importorskip("matplotlib.image")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(path)
    height, width = pixels.shape[:2]
    assert width >= min_size[0] and height >= min_size[1], (width, height)
    ink = (pixels[..., :3].mean(axis=2) < 0.9).mean()      # share of pixels not white
    assert 0.02 < ink < 0.6, ink


def test_inspect_draws_the_topology_and_prints_the_axes(tmp_path, capsys):
    out = tmp_path / "topo.png"
    plan = GOLDEN / "titan-moe-pp2-h100x16.plan.json"
    assert main(["inspect", str(plan), "--topology", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pp      2 ranks x 8 groups   rank 0's: 0, 8; nodes 0, 1" in text
    assert "dp      8 ranks x 2 groups   rank 0's: 0-7; node 0" in text
    assert "crosses nvlink4 x18 GPU-NVSwitch (450.0 GB/s)" in text
    assert "ib-ndr NIC-leaf switch (50.0 GB/s)" in text
    _check_image(out, (1000, 500))


def test_cluster_show_draws_a_large_cluster(tmp_path, capsys):
    out = tmp_path / "c.png"
    assert main(["cluster", "show", "dgx-h100:128", "--png", str(out)]) == 0
    assert "nodes drawn in detail: 0, 1, 127" in capsys.readouterr().out
    _check_image(out, (1200, 500))


def test_the_topology_needs_the_plans_cluster(tmp_path, capsys):
    plan = str(GOLDEN / "titan-moe-pp2-h100x16.plan.json")
    out = tmp_path / "t.png"
    for argv, says in (
            (["inspect", plan, "--topology", str(out), "--cluster", "dgx-h100:4"],
             "--cluster is not the plan's cluster"),
            (["inspect", plan, "--cluster", "dgx-h100:2"], "give --model or --topology"),
            (["cluster", "show", "dgx-h100", "--png", str(tmp_path / "c.txt")],
             "--png '" + str(tmp_path / "c.txt") + "': write a")):
        assert main(argv) != 0
        assert says in capsys.readouterr().err
    assert not out.exists()
