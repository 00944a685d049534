"""Tests for autoplan.cluster: presets, topology, collective model, files, validation, local."""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import pickle

import networkx as nx
import pytest
import yaml

from autoplan.cluster import Cluster, DeviceSpec, HostSpec, LinkSpec
from autoplan.cluster import local as local_mod
from autoplan.cluster import specs
from autoplan.errors import ClusterError

GIB = float(1 << 30)
MIB = float(1 << 20)
PRESETS = ("dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "hgx-h100", "hgx-h200", "pcie-8gpu", "dgx-1-v100",
           "eth-a100-80gb")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


@pytest.fixture(scope="module")
def dgx() -> Cluster:
    return Cluster.preset("dgx-a100-80gb")


@pytest.fixture(scope="module")
def dgx16() -> Cluster:
    return Cluster.preset("dgx-a100-80gb", nodes=16)


# --------------------------------------------------------------------------- presets and graph
@pytest.mark.parametrize("name", PRESETS)
def test_preset_builds_connected(name):
    cluster = Cluster.preset(name)
    assert name in specs.preset_names()
    assert cluster.world_size == 8 and cluster.num_nodes == 1
    assert cluster.backend == "nccl" and cluster.device.kind == "gpu"
    assert nx.is_connected(cluster.graph)
    assert all("kind" in data for _, data in cluster.graph.nodes(data=True))
    for _, _, data in cluster.graph.edges(data=True):
        assert data["bandwidth_bytes_per_s"] > 0 and data["latency_s"] >= 0 and data["link"] in cluster.links
    assert cluster.device_names == tuple(f"n0.gpu{i}" for i in range(8))
    assert all(cluster.graph.nodes[d]["kind"] == "gpu" for d in cluster.device_names)
    assert cluster.group_bandwidth_bytes_per_s(range(8)) > 0


def test_multi_node_ranks_and_graph():
    cluster = Cluster.preset("dgx-h100", nodes=4)
    assert cluster.world_size == 32
    assert cluster.device_names[9] == "n1.gpu1" and cluster.node_of(9) == 1 and cluster.node_of(31) == 3
    assert nx.is_connected(cluster.graph)
    kinds = {data["kind"] for _, data in cluster.graph.nodes(data=True)}
    assert {"gpu", "nvswitch", "pcie_switch", "socket", "nic", "leaf"} <= kinds
    with pytest.raises(ClusterError, match="rank 32"):
        cluster.node_of(32)


def test_graph_is_immutable(dgx):
    with pytest.raises(nx.NetworkXError):
        dgx.graph.add_node("intruder")
    with pytest.raises(AttributeError):
        dgx.num_nodes = 3


def test_nvswitch_bandwidth_equals_spec(dgx):
    nvlink3 = specs.load_link("nvlink3")
    edge = dgx.graph.edges["n0.gpu0", "n0.nvswitch"]
    assert edge["bandwidth_bytes_per_s"] == pytest.approx(300e9)  # 600 GB/s bidirectional per A100
    assert edge["link"] == "nvlink3" and edge["lanes"] == 12
    expected = 12 * nvlink3.effective_bandwidth_bytes_per_s
    for ranks in ([0, 1], [0, 5], [0, 1, 2, 3], list(range(8))):
        assert dgx.group_bandwidth_bytes_per_s(ranks) == pytest.approx(expected)
    h100 = Cluster.preset("dgx-h100")
    assert h100.graph.edges["n0.gpu3", "n0.nvswitch"]["bandwidth_bytes_per_s"] == pytest.approx(450e9)
    assert h100.group_bandwidth_bytes_per_s(range(8)) == pytest.approx(18 * specs.load_link("nvlink4").effective_bandwidth_bytes_per_s)


def test_pcie_without_nvlink_is_slower_and_crossing_sockets_slower_still(dgx):
    pcie = Cluster.preset("pcie-8gpu")
    same_switch = pcie.group_bandwidth_bytes_per_s([0, 1, 2, 3])
    cross_socket = pcie.group_bandwidth_bytes_per_s([0, 4])
    whole = pcie.group_bandwidth_bytes_per_s(range(8))
    assert same_switch == pytest.approx(specs.load_link("pcie4-x16").effective_bandwidth_bytes_per_s)
    assert same_switch < dgx.group_bandwidth_bytes_per_s([0, 1, 2, 3])
    assert cross_socket < same_switch and whole < same_switch
    assert cross_socket == pytest.approx(specs.load_link("upi").effective_bandwidth_bytes_per_s)
    # a badly interleaved group still gets a ring that crosses the sockets only twice
    assert pcie.group_bandwidth_bytes_per_s([0, 4, 1, 5]) == pytest.approx(cross_socket)
    assert pcie.collective_time_s("all_reduce", GIB, range(8)) > dgx.collective_time_s("all_reduce", GIB, range(8))


def test_v100_hybrid_cube_mesh():
    v100 = Cluster.preset("dgx-1-v100")
    g = v100.graph
    nvlink_lanes = {i: 0 for i in range(8)}
    for u, v, data in g.edges(data=True):
        if data["link"] == "nvlink2":
            assert g.nodes[u]["kind"] == "gpu" and g.nodes[v]["kind"] == "gpu"
            nvlink_lanes[g.nodes[u]["local_rank"]] += data["lanes"]
            nvlink_lanes[g.nodes[v]["local_rank"]] += data["lanes"]
    assert nvlink_lanes == {i: 6 for i in range(8)}  # six NVLinks per V100
    assert g.edges["n0.gpu0", "n0.gpu3"]["bandwidth_bytes_per_s"] == pytest.approx(50e9)  # NV2
    assert g.edges["n0.gpu0", "n0.gpu1"]["bandwidth_bytes_per_s"] == pytest.approx(25e9)  # NV1
    assert not g.has_edge("n0.gpu0", "n0.gpu5")
    lane = specs.load_link("nvlink2").effective_bandwidth_bytes_per_s
    assert v100.group_bandwidth_bytes_per_s([0, 3]) == pytest.approx(2 * lane)
    assert v100.group_bandwidth_bytes_per_s([0, 1]) == pytest.approx(lane)
    # rings over the cube-mesh in both directions use all six links of every GPU
    assert v100.group_bandwidth_bytes_per_s(range(8)) == pytest.approx(6 * lane)
    # 0 and 5 share no NVLink: their traffic crosses PCIe and the QPI link
    assert v100.group_bandwidth_bytes_per_s([0, 5]) == pytest.approx(specs.load_link("qpi").effective_bandwidth_bytes_per_s)
    assert v100.p2p_time_s(GIB, 0, 5) > 5 * v100.p2p_time_s(GIB, 0, 3)


# --------------------------------------------------------------------------- collective model
def test_collective_bytes_per_rank():
    n, nb = 8, 1000.0
    assert Cluster.collective_bytes_per_rank("all_reduce", nb, n) == pytest.approx(2 * 7 / 8 * nb)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert Cluster.collective_bytes_per_rank(kind, nb, n) == pytest.approx(7 / 8 * nb)
    assert Cluster.collective_bytes_per_rank("broadcast", nb, n) == nb
    assert Cluster.collective_bytes_per_rank("all_reduce", nb, 1) == 0.0
    with pytest.raises(ClusterError, match="all_reduce"):
        Cluster.collective_bytes_per_rank("allreduce", nb, n)


def test_ring_all_reduce_time_matches_bytes_over_bandwidth(dgx):
    ranks = list(range(8))
    bw = dgx.group_bandwidth_bytes_per_s(ranks)
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        est = dgx.collective_estimate(kind, GIB, ranks)
        wire = Cluster.collective_bytes_per_rank(kind, GIB, 8)
        assert est.algorithm == "ring"
        assert est.time_s - est.latency_s == pytest.approx(wire / bw)
        assert est.bandwidth_bytes_per_s == pytest.approx(bw)
        assert est.time_s == pytest.approx(dgx.collective_time_s(kind, GIB, ranks))
    steps = dgx.collective_estimate("all_reduce", GIB, ranks).latency_s / dgx.collective_estimate("all_gather", GIB, ranks).latency_s
    assert steps == pytest.approx(2.0)  # 2(n-1) vs (n-1) alpha steps
    ar = dgx.collective_time_s("all_reduce", GIB, ranks)
    assert ar == pytest.approx(dgx.collective_time_s("reduce_scatter", GIB, ranks) + dgx.collective_time_s("all_gather", GIB, ranks))
    assert dgx.collective_time_s("all_to_all", GIB, ranks) == pytest.approx(dgx.collective_time_s("all_gather", GIB, ranks), rel=1e-3)
    assert dgx.collective_time_s("all_reduce", 2 * GIB, ranks) > 1.9 * ar * (1 - 1e-3)


def test_one_rank_and_zero_bytes(dgx):
    for kind in KINDS:
        assert dgx.collective_time_s(kind, GIB, [3]) == 0.0
        assert 0.0 < dgx.collective_time_s(kind, 0, [0, 1]) < 1e-4  # latency only
    assert dgx.p2p_time_s(GIB, 2, 2) == 0.0
    assert math.isinf(dgx.group_bandwidth_bytes_per_s([5]))


def test_bad_groups_are_rejected(dgx):
    with pytest.raises(ClusterError, match="rank 8"):
        dgx.collective_time_s("all_reduce", GIB, [0, 8])
    with pytest.raises(ClusterError, match="more than once"):
        dgx.collective_time_s("all_reduce", GIB, [0, 1, 1])
    with pytest.raises(ClusterError, match="empty"):
        dgx.collective_time_s("all_reduce", GIB, [])
    with pytest.raises(ClusterError, match="nbytes"):
        dgx.collective_time_s("all_reduce", -1, [0, 1])
    with pytest.raises(ClusterError, match="unknown collective"):
        dgx.collective_time_s("gather", GIB, [0, 1])


def test_hierarchical_beats_flat_across_nodes(dgx16):
    world = list(range(dgx16.world_size))
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        est = dgx16.collective_estimate(kind, 16 * MIB, world)
        assert est.hierarchical_time_s is not None and est.hierarchical_time_s < est.flat_time_s
        assert est.algorithm == "hierarchical" and est.time_s == pytest.approx(est.hierarchical_time_s)
    for nbytes in (MIB, GIB):  # the reported time is always the cheaper algorithm
        est = dgx16.collective_estimate("all_reduce", nbytes, world)
        assert est.time_s == pytest.approx(min(est.flat_time_s, est.hierarchical_time_s))
    # one rank per node: nothing to be hierarchical about
    assert dgx16.collective_estimate("all_reduce", GIB, [8 * i for i in range(16)]).hierarchical_time_s is None
    slow = Cluster.preset("eth-a100-80gb", nodes=4)
    est = slow.collective_estimate("all_reduce", 64 * MIB, range(32))
    assert est.algorithm == "hierarchical" and est.time_s < est.flat_time_s


def test_group_in_one_node_beats_same_size_across_nodes(dgx16):
    inside, across = list(range(8)), [8 * i for i in range(8)]
    for kind in KINDS:
        assert dgx16.collective_time_s(kind, 256 * MIB, inside) < dgx16.collective_time_s(kind, 256 * MIB, across)
    assert dgx16.p2p_time_s(GIB, 0, 1) < dgx16.p2p_time_s(GIB, 0, 8)
    # a rank's NIC share: one HDR port per A100 in a DGX A100, reached over the GPU's PCIe link
    share = min(specs.load_link("ib-hdr").effective_bandwidth_bytes_per_s,
                specs.load_link("pcie4-x16").effective_bandwidth_bytes_per_s)
    assert dgx16.group_bandwidth_bytes_per_s(across) == pytest.approx(share)
    assert dgx16.group_bandwidth_bytes_per_s(range(16)) == pytest.approx(8 * share)
    eth = Cluster.preset("eth-a100-80gb", nodes=2)
    assert eth.collective_time_s("all_reduce", GIB, range(16)) > 10 * dgx16.collective_time_s("all_reduce", GIB, range(16))


def test_oversubscription_slows_groups_that_span_leaves():
    base = Cluster.preset("dgx-a100-80gb", nodes=8)
    data = base.to_dict()
    data["fabric"]["oversubscription"] = 2.0
    over = Cluster.from_dict(data)
    across = [8 * i for i in range(8)]  # NICs of eight nodes sit on several leaves
    assert over.group_bandwidth_bytes_per_s(across) == pytest.approx(base.group_bandwidth_bytes_per_s(across) / 2)
    assert over.group_bandwidth_bytes_per_s(range(8)) == pytest.approx(base.group_bandwidth_bytes_per_s(range(8)))
    assert over.fingerprint() != base.fingerprint()


def test_1024_gpu_cluster_prices_groups_from_a_cache():
    """Pricing a collective over 1,024 GPUs is computed once per group, then looked up (the
    timings are in benchmarks/search_time.py; tests assert no wall-clock time)."""
    big = Cluster.preset("dgx-a100-80gb", nodes=128)
    assert big.world_size == 1024
    world = list(range(1024))
    first = big.collective_time_s("all_reduce", GIB, world)
    cached = len(big._group_cache)
    for _ in range(200):
        assert big.collective_time_s("all_reduce", GIB, world) == first
    assert first > 0 and len(big._group_cache) == cached   # no new group was computed
    for tp in range(8):  # strided data-parallel groups, one per TP rank
        big.collective_time_s("all_reduce", GIB, range(tp, 1024, 8))
    assert len(big._group_cache) == cached + 8


# --------------------------------------------------------------------------- serialisation
def test_to_dict_round_trip_and_fingerprint(dgx):
    data = dgx.to_dict()
    again = Cluster.from_dict(json.loads(json.dumps(data)))
    assert again.to_dict() == data
    assert again.fingerprint() == dgx.fingerprint() == Cluster.preset("dgx-a100-80gb").fingerprint()
    assert len(dgx.fingerprint()) == 64 and int(dgx.fingerprint(), 16) >= 0
    assert again == dgx and hash(again) == hash(dgx)
    assert pickle.loads(pickle.dumps(dgx)) == dgx and copy.deepcopy(dgx) == dgx
    assert Cluster.preset("dgx-a100-80gb", nodes=2).fingerprint() != dgx.fingerprint()
    assert Cluster.preset("dgx-a100-40gb").fingerprint() != dgx.fingerprint()
    reworded = dict(data, description="another description")
    assert Cluster.from_dict(reworded).fingerprint() == dgx.fingerprint()  # descriptive fields only


def test_from_file_yaml_and_json(tmp_path, dgx):
    as_json = tmp_path / "cluster.json"
    as_json.write_text(json.dumps(dgx.to_dict()))
    assert Cluster.from_file(as_json).fingerprint() == dgx.fingerprint()
    as_yaml = tmp_path / "mine.yaml"
    as_yaml.write_text(yaml.safe_dump(dgx.to_dict()))
    assert Cluster.from_file(as_yaml).fingerprint() == dgx.fingerprint()
    # a hand-written file starting from a preset
    custom = tmp_path / "custom.yml"
    custom.write_text("preset: dgx-h100\nname: my-h100\nnum_nodes: 2\nfabric: {oversubscription: 2.0}\n"
                      "host: {memory_bytes: 1.0e+12}\n")
    mine = Cluster.from_file(custom)
    assert mine.name == "my-h100" and mine.world_size == 16 and mine.fabric.oversubscription == 2.0
    assert mine.host.memory_bytes == 10**12 and mine.host.cpu_adam_params_per_s > 0
    # a small file written from scratch: two CPU-like GPUs on PCIe, inline device and link
    scratch = tmp_path / "scratch.yaml"
    scratch.write_text(yaml.safe_dump({
        "name": "two-gpu", "devices_per_node": 2, "device": "A100-PCIE-80GB",
        "host": {"memory_bytes": 2**37, "device_to_host_bandwidth_bytes_per_s": 2.0e10, "cpu_adam_params_per_s": 1e8},
        "links": {"fast-pcie": {"bandwidth_bytes_per_s": 4.0e10, "latency_s": 1e-6, "source": "test"}},
        "node": {"components": {"sw": "pcie_switch"}, "links": [{"a": ["gpu0", "gpu1"], "b": "sw", "link": "fast-pcie"}]},
    }))
    two = Cluster.from_file(scratch)
    assert two.world_size == 2 and two.group_bandwidth_bytes_per_s([0, 1]) == pytest.approx(4.0e10)


def _dgx_dict() -> dict:
    return Cluster.preset("dgx-a100-80gb").to_dict()


def _set(path, value):
    def mutate(d):
        target = d
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return d
    return mutate


def _disconnect_gpu7(d):
    d["node"]["links"] = [li for li in d["node"]["links"] if "gpu7" not in (li["a"], li["b"])]
    return d


def _unknown_link(d):
    d["node"]["links"][0]["link"] = "nvlink9"
    return d


def _bad_endpoint(d):
    d["node"]["links"][0]["b"] = "nvswich"
    return d


def _no_fabric(d):
    d["num_nodes"] = 2
    d["fabric"] = None
    return d


MALFORMED = {
    "unknown top-level key": (_set(["devices_per_nod"], 8), ["devices_per_nod", "allowed"]),
    "unknown key in a link": (_set(["node", "links", 0, "lane"], 12), ["lane", "node.links[0]", "allowed"]),
    "negative bandwidth": (_set(["links", "nvlink3", "bandwidth_bytes_per_s"], -25e9), ["nvlink3", "bandwidth_bytes_per_s", "> 0"]),
    "zero bandwidth": (_set(["links", "pcie4-x16", "bandwidth_bytes_per_s"], 0), ["pcie4-x16", "bandwidth_bytes_per_s"]),
    "disconnected device": (_disconnect_gpu7, ["gpu7", "not connected"]),
    "zero host memory": (_set(["host", "memory_bytes"], 0), ["host", "memory_bytes"]),
    "negative device memory": (_set(["device", "memory_bytes"], -1), ["device", "memory_bytes"]),
    "nodes below one": (_set(["num_nodes"], 0), ["num_nodes", ">= 1"]),
    "unknown link type": (_unknown_link, ["nvlink9", "known link types", "nvlink3"]),
    "unknown device": (_set(["device"], "A300"), ["A300", "known devices", "A100-SXM4-80GB"]),
    "unknown component kind": (_set(["node", "components", "nvswitch"], "nvswich"), ["nvswich", "allowed"]),
    "unknown endpoint": (_bad_endpoint, ["nvswich", "endpoint"]),
    "multi-node without fabric": (_no_fabric, ["fabric"]),
    "zero oversubscription": (_set(["fabric", "oversubscription"], 0), ["oversubscription"]),
    "efficiency above one": (_set(["links", "nvlink3", "efficiency"], 1.5), ["nvlink3", "efficiency"]),
    "bad backend": (_set(["backend"], "mpi"), ["mpi", "nccl"]),
    "text where a number goes": (_set(["device", "memory_bandwidth_bytes_per_s"], "fast"), ["memory_bandwidth_bytes_per_s", "fast"]),
    "wrong schema version": (_set(["schema_version"], 7), ["schema_version", "7"]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_description_names_the_item(case, tmp_path):
    mutate, needles = MALFORMED[case]
    data = mutate(copy.deepcopy(_dgx_dict()))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ClusterError) as err:
        Cluster.from_file(path)
    for needle in needles:
        assert needle in str(err.value), (case, str(err.value))


def test_malformed_files_and_specs(tmp_path):
    with pytest.raises(ClusterError, match="unknown cluster preset 'dgx-z'.*dgx-a100-80gb"):
        Cluster.preset("dgx-z")
    with pytest.raises(ClusterError, match="nodes"):
        Cluster.preset("dgx-h100", nodes=0)
    with pytest.raises(ClusterError, match="no cluster file at"):
        Cluster.from_file(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(ClusterError, match="not valid YAML"):
        Cluster.from_file(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ClusterError, match="mapping"):
        Cluster.from_file(listed)
    with pytest.raises(ClusterError, match="presets: .*dgx-h100"):
        Cluster.from_spec("no-such-thing")
    with pytest.raises(ClusterError, match="whole number"):
        Cluster.from_spec("dgx-h100:two")
    twice = _dgx_dict()
    twice["node"]["links"].append(dict(twice["node"]["links"][0]))
    with pytest.raises(ClusterError, match="listed twice"):
        Cluster.from_dict(twice)


def test_from_spec(tmp_path, dgx):
    assert Cluster.from_spec("dgx-a100-80gb:2").world_size == 16
    assert Cluster.from_spec("hgx-h200").world_size == 8
    assert Cluster.from_spec("local").backend == "gloo"
    assert Cluster.from_spec("local:3").world_size == 3
    path = tmp_path / "c.json"
    path.write_text(json.dumps(dgx.to_dict()))
    assert Cluster.from_spec(str(path)) == dgx


def test_part_of_a_node_by_name(tmp_path):
    """``PRESET/K``: the preset's node with its first K devices, named as written in specs,
    files, plans and fingerprints; the host shares grow to the devices left."""
    one = Cluster.from_spec("dgx-h100/1")
    full = Cluster.preset("dgx-h100")
    assert (one.name, one.world_size, one.devices_per_node) == ("dgx-h100/1", 1, 1)
    assert one.device == full.device and one.host.memory_bytes == full.host.memory_bytes
    # two GPUs share a PCIe switch's uplink in a DGX: alone, the first gets all of it
    assert one.host.device_to_host_bandwidth_bytes_per_s == 2 * full.host.device_to_host_bandwidth_bytes_per_s
    assert one.host.cpu_adam_params_per_s == 8 * full.host.cpu_adam_params_per_s
    assert Cluster.from_spec("pcie-8gpu/1").host.device_to_host_bandwidth_bytes_per_s == \
        4 * Cluster.preset("pcie-8gpu").host.device_to_host_bandwidth_bytes_per_s
    assert one.hardware().node_links == full.hardware().node_links
    four = Cluster.from_spec("dgx-a100-80gb/2:4")
    assert (four.name, four.num_nodes, four.world_size) == ("dgx-a100-80gb/2", 4, 8)
    assert four.host.device_to_host_bandwidth_bytes_per_s == \
        Cluster.preset("dgx-a100-80gb").host.device_to_host_bandwidth_bytes_per_s
    assert four.collective_time_s("all_reduce", GIB, [0, 1]) < four.collective_time_s("all_reduce", GIB, [0, 2])
    # the same cluster however it is named; read back from its description and from a plan
    assert Cluster.preset("dgx-h100/1") == one == Cluster.from_dict(json.loads(json.dumps(one.to_dict())))
    assert Cluster.from_spec("dgx-h100/1:1") == one
    from autoplan.planner.planfile import ClusterInfo
    info = ClusterInfo.of(one)
    assert Cluster.from_spec(f"{info.name}:{info.num_nodes}").fingerprint() == info.fingerprint
    # a cluster file starting from it overrides the host key by key: 1 TB of host memory
    path = tmp_path / "one-h100.yaml"
    path.write_text("preset: dgx-h100/1\nhost: {memory_bytes: 1099511627776}\n")
    mine = Cluster.from_file(path)
    assert mine.name == "dgx-h100/1" and mine.host.memory_bytes == 1 << 40
    assert mine.host.device_to_host_bandwidth_bytes_per_s == one.host.device_to_host_bandwidth_bytes_per_s
    for bad, match in (("dgx-h100/0", "keep 1 to 8"), ("dgx-h100/9", "keep 1 to 8"),
                       ("dgx-h100/01", "not a device count"), ("dgx-h100/x", "PRESET/K"),
                       ("dgx-z/1", "neither a file nor a preset")):
        with pytest.raises(ClusterError, match=match):
            Cluster.from_spec(bad)
    with pytest.raises(ClusterError, match="not a device count"):
        Cluster.preset("dgx-h100/-1")


# --------------------------------------------------------------------------- specs and data
def test_device_specs():
    a100 = specs.load_device("A100-SXM4-80GB")
    assert a100.peak_flops_for("bf16") == pytest.approx(312e12)
    assert a100.peak_flops_for("fp32") == pytest.approx(19.5e12)  # not TF32: conservative
    assert a100.peak_flops["tf32"] == pytest.approx(156e12)
    assert a100.memory_bandwidth_bytes_per_s == pytest.approx(2.039e12)
    assert specs.load_device("A100-SXM4-40GB").memory_bandwidth_bytes_per_s == pytest.approx(1.555e12)
    h100 = specs.load_device("H100-SXM5-80GB")
    assert h100.peak_flops_for("bf16") == pytest.approx(989.4e12) and h100.peak_flops_for("fp32") == pytest.approx(67e12)
    h200 = specs.load_device("H200-SXM-141GB")
    assert h200.memory_bandwidth_bytes_per_s == pytest.approx(4.8e12) and h200.memory_bytes == 141 * 2**30
    v100 = specs.load_device("V100-SXM2-32GB")
    assert v100.peak_flops_for("fp16") == pytest.approx(125e12)
    with pytest.raises(ClusterError, match="V100-SXM2-32GB.*bf16.*fp16"):
        v100.peak_flops_for("bf16")
    hash(a100)  # frozen specs stay hashable
    with pytest.raises(TypeError):
        a100.peak_flops["bf16"] = 1.0
    assert DeviceSpec.from_dict(a100.to_dict()) == a100
    assert specs.find_device_by_alias("NVIDIA A100-SXM4-80GB") == a100
    # the H100's GEMM rate by shape (OpenXLA's sm_90 table), kept through a round trip and
    # shared by the H200; a device without one writes none
    table = h100.matmul_shape_efficiency
    assert table.sides == (256.0, 512.0, 1024.0, 2048.0, 4096.0)
    assert table.fraction(4096, 4096, 4096) == 1.0
    assert table.fraction(512, 4096, 4096) == pytest.approx(661.6 / 780.2, abs=1e-3)
    assert table.fraction(4096, 2048, 2048) == pytest.approx(727.5 / 780.2, abs=1e-3)
    assert h200.matmul_shape_efficiency == table
    assert DeviceSpec.from_dict(h100.to_dict()) == h100
    assert "matmul_shape_efficiency" not in a100.to_dict()
    good = table.to_value()
    for bad, says in ((5, "mapping with 'sides'"), ({"sides": [1]}, "mapping with 'sides'"),
                      ({**good, "sides": "256"}, "list of sizes"),
                      ({**good, "sides": [512, 256, 1024, 2048, 4096]}, "rising"),
                      ({**good, "fractions": good["fractions"][:4]}, "list of 5 entries"),
                      ({**good, "fractions": [[[0.5] * 5] * 5] * 4 + [[[0.5] * 5] * 5 + [[3.0] * 5]]},
                       r"list of 5 entries"),
                      ({**good, "fractions": [[[0.5] * 5] * 5] * 4 + [[[0.5] * 5] * 4 + [[3.0] * 5]]},
                       "<= 2.0"),
                      ({**good, "fractions": [[["x"] * 5] * 5] * 5}, "must be a number")):
        with pytest.raises(ClusterError, match=says):
            DeviceSpec.from_dict({**a100.to_dict(), "matmul_shape_efficiency": bad})
    link = specs.load_link("ib-ndr")
    assert LinkSpec.from_dict(link.to_dict()) == link and link.bandwidth_bytes_per_s == pytest.approx(50e9)
    host = HostSpec(memory_bytes=2**40, device_to_host_bandwidth_bytes_per_s=1e10, cpu_adam_params_per_s=1e8)
    assert HostSpec.from_dict(host.to_dict()) == host


def test_a_gemm_shape_table_interpolates_in_log_sides_and_holds_beyond_its_grid():
    """Exact at the grid's points, linear in the logarithm of each side between them (the
    geometric middle of two sides averages them), held at the grid's ends."""
    from autoplan.cluster.gemm_table import GemmShapeTable
    sides = (256.0, 1024.0)
    # fraction = M-index + 2 N-index + 4 K-index, scaled: each side's effect separable
    table = GemmShapeTable(sides, tuple(0.1 * (1 + i + 2 * j + 4 * k)
                                        for i in range(2) for j in range(2) for k in range(2)))
    assert table.fraction(256, 256, 256) == pytest.approx(0.1)
    assert table.fraction(1024, 256, 256) == pytest.approx(0.2)
    assert table.fraction(256, 1024, 256) == pytest.approx(0.3)
    assert table.fraction(256, 256, 1024) == pytest.approx(0.5)
    assert table.fraction(512, 256, 256) == pytest.approx(0.15)          # log middle
    assert table.fraction(512, 512, 512) == pytest.approx(0.1 * (1 + 0.5 + 1 + 2))
    assert table.fraction(64, 10, 1) == pytest.approx(0.1)               # held below
    assert table.fraction(1e6, 1e6, 1e6) == pytest.approx(0.8)           # held above
    assert GemmShapeTable.from_value(table.to_value(), "t") == table
    with pytest.raises(ClusterError, match="8 fractions"):
        GemmShapeTable(sides, (0.5,) * 7)


def test_every_number_in_cost_models_has_a_source():
    def numeric(entry):
        return any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in entry.values())

    for name, entry in specs.raw_data("devices.yaml")["devices"].items():
        assert entry.get("source", "").strip(), name
        assert "http" in entry["source"], name
    for name, entry in specs.raw_data("links.yaml")["links"].items():
        assert entry.get("source", "").strip(), name
    for name, entry in specs.raw_data("clusters.yaml")["presets"].items():
        assert entry.get("source", "").strip(), name
        for part in ("host", "fabric"):
            if isinstance(entry.get(part), dict) and numeric(entry[part]):
                assert entry[part].get("source", "").strip(), (name, part)
    assert set(PRESETS) <= set(specs.preset_names())


# --------------------------------------------------------------------------- local machine
def test_local_cpu_cluster():
    one = Cluster.local()
    assert one.world_size == 1 and one.backend == "gloo" and one.device.kind == "cpu"
    assert one.device.name == local_mod.local_cpu_device_name() and one.device.name.startswith("cpu-")
    assert one.collective_time_s("all_reduce", GIB, [0]) == 0.0
    four = Cluster.local(4, calibration={"matmul_flops_per_s": 2e11, "launch_s": 3e-6})
    assert four.world_size == 4 and four.device_names == tuple(f"n0.cpu{i}" for i in range(4))
    assert four.device.memory_bytes == four.host.memory_bytes // 4
    assert four.device.peak_flops_for("fp32") == pytest.approx(2e11) and four.device.kernel_launch_s == pytest.approx(3e-6)
    assert "calibration" in four.device.source
    # without an explicit calibration, local() takes the installed profile's, if there is one
    from autoplan.cluster.profile_db import ProfileDB
    profiled = ProfileDB.find(one.device.name)
    if profiled is None:
        assert "PLACEHOLDER" in one.device.source
    else:
        assert "calibration measured" in one.device.source
        assert one.device.peak_flops_for("fp32") == pytest.approx(
            profiled.calibration.matmul_flops_per_s)
    loop = specs.load_link("loopback")
    share = min(1.0, (os.cpu_count() or 1) / 4)      # ranks that outnumber the cores share them
    assert four.device.compute_share == pytest.approx(share)
    assert four.group_bandwidth_bytes_per_s(range(4)) == pytest.approx(
        loop.effective_bandwidth_bytes_per_s * share)
    assert four.collective_time_s("all_reduce", MIB, range(4)) > four.collective_time_s("all_reduce", MIB, [0, 1])
    with pytest.raises(ClusterError, match="matmul_flops"):
        Cluster.local(2, calibration={"matmul_flops": 1e9})


def test_cpu_name_slug():
    assert local_mod.slug("Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz") == "intel-xeon-platinum-8375c"
    assert local_mod.slug("AMD EPYC 7R13 Processor") == "amd-epyc-7r13"


DGX1_TOPO = """\
\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tmlx5_0\tCPU Affinity\x1b[0m
GPU0\t X \tNV1\tNV1\tNV2\tNV2\tSYS\tSYS\tSYS\tPIX\t0-19,40-59
GPU1\tNV1\t X \tNV2\tNV1\tSYS\tNV2\tSYS\tSYS\tPIX\t0-19,40-59
GPU2\tNV1\tNV2\t X \tNV2\tSYS\tSYS\tNV1\tSYS\tPHB\t0-19,40-59
GPU3\tNV2\tNV1\tNV2\t X \tSYS\tSYS\tSYS\tNV1\tPHB\t0-19,40-59
GPU4\tNV2\tSYS\tSYS\tSYS\t X \tNV1\tNV1\tNV2\tSYS\t20-39,60-79
GPU5\tSYS\tNV2\tSYS\tSYS\tNV1\t X \tNV2\tNV1\tSYS\t20-39,60-79
GPU6\tSYS\tSYS\tNV1\tSYS\tNV1\tNV2\t X \tNV2\tSYS\t20-39,60-79
GPU7\tSYS\tSYS\tSYS\tNV1\tNV2\tNV1\tNV2\t X \tSYS\t20-39,60-79
mlx5_0\tPIX\tPIX\tPHB\tPHB\tSYS\tSYS\tSYS\tSYS\t X

Legend:
  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
"""


def test_nvidia_smi_topology_parsing():
    relations = local_mod.parse_nvidia_smi_topo(DGX1_TOPO)
    assert len(relations) == 8 and relations[0][3] == "NV2" and relations[0][5] == "SYS"
    data = local_mod.gpu_cluster_dict(["Tesla V100-SXM2-32GB"] * 8, [32 * 2**30] * 8, DGX1_TOPO, None)
    cluster = Cluster.from_dict(data)
    assert cluster.device.name == "V100-SXM2-32GB" and cluster.backend == "nccl"
    preset = Cluster.preset("dgx-1-v100")
    for ranks in ([0, 3], [0, 1], list(range(8))):
        assert cluster.group_bandwidth_bytes_per_s(ranks) == pytest.approx(preset.group_bandwidth_bytes_per_s(ranks))
    assert cluster.p2p_time_s(GIB, 0, 5) > cluster.p2p_time_s(GIB, 0, 1)  # across sockets, no NVLink
    nv12 = "\tGPU0\tGPU1\tGPU2\tGPU3\nGPU0\t X \tNV12\tNV12\tNV12\nGPU1\tNV12\t X \tNV12\tNV12\n" \
           "GPU2\tNV12\tNV12\t X \tNV12\nGPU3\tNV12\tNV12\tNV12\t X \n"
    switched = Cluster.from_dict(local_mod.gpu_cluster_dict(["NVIDIA A100-SXM4-80GB"] * 4, [80 * 2**30] * 4, nv12, None))
    assert "nvswitch" in dict(switched.node_topology.components)
    assert switched.group_bandwidth_bytes_per_s(range(4)) == pytest.approx(12 * specs.load_link("nvlink3").effective_bandwidth_bytes_per_s)
    unknown = Cluster.from_dict(local_mod.gpu_cluster_dict(["Some GPU 9000"] * 2, [2**34] * 2, "", None))
    assert "PLACEHOLDER" in unknown.device.source and unknown.world_size == 2
    with pytest.raises(ClusterError, match="GPU matrix"):
        local_mod.parse_nvidia_smi_topo("no matrix here")


# --------------------------------------------------------------------------- CLI and summary
def test_describe_and_cli(capsys):
    text = Cluster.preset("dgx-a100-80gb", nodes=2).describe()
    for needle in ("A100-SXM4-80GB", "nvlink3", "ib-hdr", "intra-node", "whole cluster (16 ranks)", "all_reduce"):
        assert needle in text
    from autoplan.cli import cluster_cmd

    parser = argparse.ArgumentParser()
    cluster_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cluster", "show", "dgx-h100", "--nodes", "2"])
    assert args.func(args) == 0
    assert "16 ranks" in capsys.readouterr().out
    args = parser.parse_args(["cluster", "show", "pcie-8gpu", "--json"])
    assert cluster_cmd.run(args) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "pcie-8gpu"
    args = parser.parse_args(["cluster", "show", "dgx-h100:3", "--nodes", "2"])
    with pytest.raises(ClusterError, match="--nodes"):
        cluster_cmd.run(args)


def test_a_cpu_without_a_profile_is_calibrated_once_on_first_use(tmp_path, monkeypatch, capsys,
                                                                  caplog):
    """A new machine: the first Cluster.local() measures the CPU (logged at INFO, so a plain
    run stays quiet), caches it as the profile, and later calls read that profile (the same
    figures, no second calibration)."""
    import logging

    from autoplan.cluster import local
    monkeypatch.setenv("AUTOPLAN_AUTO_CALIBRATE", "1")
    monkeypatch.setenv("AUTOPLAN_PROFILE_DIR", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(local, "local_cpu_device_name", lambda: "cpu-fresh-test-machine")
    # the stderr handler an earlier main() of this process put on the autoplan logger
    # (cli/main.py: configure_logging) prints records; without it, nothing may
    monkeypatch.setattr(logging.getLogger("autoplan"), "handlers", [])
    with caplog.at_level(logging.INFO, logger="autoplan.cluster.local"):
        first = Cluster.local(2)
    notes = caplog.text
    assert "calibrating it once" in notes and "calibrated in" in notes
    assert "calibrat" not in capsys.readouterr().err      # nothing printed past logging
    assert (tmp_path / "cpu-fresh-test-machine.json").exists()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="autoplan.cluster.local"):
        second = Cluster.local(2)
        assert "calibrating" not in caplog.text
        assert first.fingerprint() == second.fingerprint()
        assert "calibration measured on this machine" in second.device.source
        monkeypatch.setenv("WORLD_SIZE", "2")             # ranks of a job never calibrate
        monkeypatch.setattr(local, "local_cpu_device_name", lambda: "cpu-another-machine")
        Cluster.local(2)
        assert "calibrating" not in caplog.text


def test_collective_time_is_the_estimates_time_to_the_bit():
    """``collective_time_s`` (the cost model's per-tensor call) skips the breakdown that
    ``collective_estimate`` reports; it is the same figure."""
    import random
    rng = random.Random(0)
    for preset, nodes in (("dgx-h100", 8), ("dgx-a100-80gb", 4), ("dgx-a100-40gb", 1)):
        cluster = Cluster.preset(preset, nodes=nodes)
        for _ in range(500):
            n = rng.choice([1, 2, 4, 8, 16, 32])
            ranks = sorted(rng.sample(range(cluster.world_size), min(n, cluster.world_size)))
            kind = rng.choice(["all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                               "broadcast"])
            nbytes = rng.choice([0.0, 1.0, rng.random() * 1e9])
            assert (cluster.collective_time_s(kind, nbytes, ranks)
                    == cluster.collective_estimate(kind, nbytes, ranks).time_s)
