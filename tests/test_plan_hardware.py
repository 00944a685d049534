"""A plan runs where it was planned for (issue 37): plans are matched to the cluster they run on
by its hardware (device model, kind and memory, nodes, devices per node, links, network), not
by its name nor by figures that vary between identical machines. Two DGX H100 nodes as
``Cluster.local`` discovers them (from what the driver and ``nvidia-smi topo -m`` report) run a
``dgx-h100:2`` plan; a plan made for this CPU under another cluster name runs on local ranks;
other hardware is refused on every rank before any collective, naming what differs, or runs with
``allow_cluster_mismatch`` and its prediction marked stale."""

import json

import pytest
import torch
import torch.distributed as dist

import autoplan
from autoplan.cli.main import main
from autoplan.cluster import Cluster, local
from autoplan.cluster.hardware import compare
from autoplan.errors import ClusterError, PlanError
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.loading import load_plan
from autoplan.planner.planfile import Plan, plan_mismatch
from tests.distributed import run_ranks

# `nvidia-smi topo -m` on a DGX H100 (every GPU pair NV18, two NICs shown)
DGX_H100_TOPO = "\n".join(
    ["\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity"]
    + [f"GPU{i}\t" + "\t".join(" X " if j == i else "NV18" for j in range(8))
       + f"\tSYS\tSYS\t{'0-55' if i < 4 else '56-111'}\t{i // 4}" for i in range(8)])
DGX_A100_TOPO = DGX_H100_TOPO.replace("NV18", "NV12")
H100_DRIVER_BYTES = 85_028_896_768      # torch's total_memory of an "80 GB" H100 (79.2 GiB)
A100_40_DRIVER_BYTES = 42_298_834_944


def discovered(product: str, memory: int, topo: str, nodes: int) -> Cluster:
    """What ``Cluster.local_job()`` describes on ``nodes`` nodes of 8 such GPUs."""
    return Cluster.from_dict(local.gpu_nodes_dict([product] * 8, [memory] * 8, topo, None,
                                                  nodes=nodes))


@pytest.fixture(scope="module")
def tiny():
    ex = build_example("gpt-tiny", device="meta", batch_size=1)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


@pytest.fixture(scope="module")
def h100_plan(tiny):
    return autoplan.plan(tiny, "dgx-h100:2", global_batch_size=32, profile=None, max_pp=1)


# ================================================================ GPU nodes, as discovered
def test_two_dgx_h100_nodes_as_discovered_run_a_dgx_h100_plan(h100_plan, tmp_path, monkeypatch):
    here = discovered("NVIDIA H100 80GB HBM3", H100_DRIVER_BYTES, DGX_H100_TOPO, nodes=2)
    assert here.name == "local" and here.unseen == ("fabric",)      # the network is not seen
    assert compare(Cluster.preset("dgx-h100", nodes=2).hardware(), here.hardware()) == ()
    assert plan_mismatch(h100_plan, cluster=here) == ""
    path = h100_plan.save(tmp_path / "plan.json")
    assert load_plan(path, cluster=here) == h100_plan
    # without nvidia-smi the NVLinks are not seen either: not held against the plan
    blind = discovered("NVIDIA H100 80GB HBM3", H100_DRIVER_BYTES, "", nodes=2)
    assert blind.unseen == ("fabric", "node_links") and plan_mismatch(h100_plan, cluster=blind) == ""
    # the job's shape comes from torchrun's environment
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert local.job_shape() == (8, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    with pytest.raises(ClusterError, match="same number of ranks on every node"):
        local.job_shape()


def test_other_gpus_are_refused_naming_what_differs(h100_plan):
    one_a100 = discovered("NVIDIA A100-SXM4-80GB", H100_DRIVER_BYTES, DGX_A100_TOPO, nodes=1)
    msg = plan_mismatch(h100_plan, cluster=one_a100, allow_cluster_mismatch=True)
    assert "device: H100-SXM5-80GB planned, A100-SXM4-80GB here" in msg
    assert "nodes: 2 planned, 1 here" in msg and "ranks: 16 planned, 8 here" in msg
    assert "no flag runs it on 8" in msg                  # allowed or not: the mesh needs 16
    two_a100 = discovered("NVIDIA A100-SXM4-80GB", H100_DRIVER_BYTES, DGX_A100_TOPO, nodes=2)
    msg = plan_mismatch(h100_plan, cluster=two_a100)
    assert "links in a node: nvlink4 x18 + pcie5-x16 planned, nvlink3 x12 + pcie4-x16 here" in msg
    assert "--allow-cluster-mismatch" in msg and "--cluster" in msg and "ranks" not in msg
    assert plan_mismatch(h100_plan, cluster=two_a100, allow_cluster_mismatch=True) == ""
    small = discovered("NVIDIA A100-SXM4-40GB", A100_40_DRIVER_BYTES, DGX_A100_TOPO, nodes=2)
    msg = plan_mismatch(h100_plan, cluster=small)
    assert "device memory: 80.0 GiB planned, 39.4 GiB here" in msg and "may not fit" in msg
    # the network, where both sides know it
    assert "network: ib-ndr planned, ib-hdr here" in plan_mismatch(
        h100_plan, cluster=Cluster.from_dict({**Cluster.preset("dgx-h100", nodes=2).to_dict(),
                                              "fabric": {"link": "ib-hdr", "leaf_ports": 20}}))


def test_a_plan_written_before_plans_recorded_hardware_is_matched_by_device_and_sizes(
        h100_plan, tiny):
    """A schema-5 plan: no cluster.hardware, and the model's positional fingerprint (trace
    order, names included) as autoplan wrote it then."""
    old = json.loads(h100_plan.to_json())
    del old["cluster"]["hardware"]
    old.pop("op_keys", None)              # schema 7's
    old["schema_version"] = 5
    old["model"]["fingerprint"] = tiny.positional_fingerprint()
    plan = Plan.from_dict(old)
    assert plan.cluster.hardware is None and json.loads(plan.to_json()) == old
    assert plan_mismatch(plan, graph=tiny) == ""            # its model is still recognised
    assert "plan is for model" in plan_mismatch(Plan.from_dict({**old, "schema_version": 6,
                                                                "cluster": h100_plan.to_dict()[
                                                                    "cluster"]}), graph=tiny)
    here = discovered("NVIDIA H100 80GB HBM3", H100_DRIVER_BYTES, DGX_H100_TOPO, nodes=2)
    assert plan_mismatch(plan, cluster=here) == ""
    other = discovered("NVIDIA A100-SXM4-80GB", H100_DRIVER_BYTES, DGX_A100_TOPO, nodes=2)
    assert "device: H100-SXM5-80GB planned, A100-SXM4-80GB here" in plan_mismatch(plan,
                                                                                  cluster=other)
    with pytest.raises(PlanError, match="missing key.s. cluster.hardware"):
        Plan.from_dict({**old, "schema_version": 6})


def test_unseen_round_trips_and_is_checked():
    here = discovered("NVIDIA H100 80GB HBM3", H100_DRIVER_BYTES, "", nodes=2)
    again = Cluster.from_dict(here.to_dict())
    assert again.unseen == here.unseen and again.fingerprint() == here.fingerprint()
    assert "not discovered (assumed): fabric, node_links" in here.describe()
    with pytest.raises(ClusterError, match="unseen lists what discovery could not see"):
        Cluster.from_dict({**here.to_dict(), "unseen": ["colour"]})
    # presets and files without it keep their fingerprints
    assert "unseen" not in Cluster.preset("dgx-h100").to_dict()


# ================================================================ CPU ranks, really run
GBS = 4


def _run(rank, world, plans):
    """Each plan compiled on this rank: ("ok", losses, stale note) or ("refused", message,
    whether a process group had started)."""
    out = []
    for path, allow in plans:
        ex = build_example("gpt-tiny", batch_size=GBS, seed=0, device="cpu")
        small = build_example("gpt-tiny", batch_size=1, seed=0, device="cpu")
        try:
            trainer = autoplan.compile(
                ex.model, "local", example_inputs=small.example_inputs,
                example_targets=small.targets, loss_fn=ex.loss_fn,
                optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch_size=GBS,
                plan=path, allow_cluster_mismatch=allow)
        except PlanError as e:
            out.append(("refused", str(e), dist.is_initialized()))
            continue
        batch = tuple(ex.example_inputs) + (ex.targets,)
        out.append(("ok", [trainer.step(batch) for _ in range(2)], trainer.stale_prediction))
    return out


def _plan_on(cluster_file, tmp_path, name):
    ex = build_example("gpt-tiny", batch_size=1, seed=0, device="cpu")
    graph = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    plan = autoplan.plan(graph, Cluster.from_file(cluster_file), global_batch_size=GBS,
                         profile=None, force={"tp": 2})
    return plan.save(tmp_path / f"{name}.plan.json")


def test_plans_for_this_cpu_under_another_name_or_other_cpus_run_on_local_ranks(tmp_path):
    here = Cluster.local(2).to_dict()
    same = tmp_path / "bench-box.json"           # this machine, described under another name
    same.write_text(json.dumps({**here, "name": "bench-box", "description": "the bench box"}))
    other = tmp_path / "other-cpus.json"         # 2 ranks of another CPU, measured elsewhere
    device = {**here["device"], "name": "cpu-some-other-model",
              "memory_bytes": here["device"]["memory_bytes"] * 4,
              "peak_flops": {k: v * 3 for k, v in here["device"]["peak_flops"].items()}}
    other.write_text(json.dumps({**here, "name": "lab", "device": device}))
    gpus = tmp_path / "two-gpus.json"            # the same world size on other hardware
    gpus.write_text(json.dumps({
        "name": "two-a100-box", "device": "A100-SXM4-80GB", "devices_per_node": 2,
        "host": {"memory_bytes": 1 << 40, "device_to_host_bandwidth_bytes_per_s": 31.5e9,
                 "cpu_adam_params_per_s": 2e8},
        "node": {"components": {"socket0": "socket"},
                 "links": [{"a": ["gpu0", "gpu1"], "b": "socket0", "link": "pcie4-x16"}]}}))
    plans = [_plan_on(f, tmp_path, f.stem) for f in (same, other, gpus)]
    results = run_ranks(_run, 2, [(plans[2], False), (plans[0], False), (plans[1], False),
                                  (plans[2], True)])
    assert results[0] == results[1]                       # every rank answers alike
    refused, same_run, other_run, allowed = results[0]
    assert same_run[0] == "ok" and same_run[2] == ""       # the name does not matter
    assert all(torch.isfinite(torch.tensor(same_run[1])))
    assert other_run[0] == "ok"                            # any 2-rank CPU job runs it ...
    assert "device: cpu-some-other-model planned" in other_run[2]      # ... priced elsewhere
    assert other_run[2].endswith("stale here")
    kind, msg, started = refused                           # refused before any collective
    assert kind == "refused" and started is False
    assert "device kind: gpu planned, cpu here" in msg and "--allow-cluster-mismatch" in msg
    assert allowed[0] == "ok" and "A100-SXM4-80GB" in allowed[2]
    # the same training under another plan's sharding
    assert allowed[1] == pytest.approx(same_run[1], rel=1e-4)


def test_autoplan_run_refuses_other_hardware_before_any_rank_starts(tmp_path, capsys):
    """The CLI's pre-flight compares the plan with the cluster the ranks will discover: a
    mismatch is one message and exit 1, no torchrun started; --cluster and
    --allow-cluster-mismatch reach the ranks."""
    cluster = tmp_path / "two-gpus.yaml"
    cluster.write_text("name: two-a100-box\ndevice: A100-SXM4-80GB\ndevices_per_node: 2\n"
                       "host: {memory_bytes: 1099511627776, "
                       "device_to_host_bandwidth_bytes_per_s: 31.5e+9, "
                       "cpu_adam_params_per_s: 2.0e+8}\n"
                       "node:\n  components: {socket0: socket}\n  links:\n"
                       "    - {a: [gpu0, gpu1], b: socket0, link: pcie4-x16}\n")
    plan = str(tmp_path / "plan.json")
    assert main(["plan", "gpt-tiny", "--cluster", str(cluster), "--global-batch", "8",
                 "-o", plan, "-q"]) == 0
    capsys.readouterr()
    assert main(["run", plan, "--model", "gpt-tiny", "--steps", "1"]) == 1
    captured = capsys.readouterr()
    assert "device kind: gpu planned, cpu here" in captured.err
    assert "--allow-cluster-mismatch" in captured.err and "step" not in captured.out
    assert main(["run", plan, "--model", "gpt-tiny", "--print-command", "--cluster",
                 str(cluster), "--allow-cluster-mismatch"]) == 0
    cmd = capsys.readouterr().out
    assert f"--cluster {cluster}" in cmd and "--allow-cluster-mismatch" in cmd


def test_the_worker_passes_the_cluster_and_the_mismatch_flag_to_compile(tmp_path, capfd):
    """``autoplan run``'s ranks (runtime/worker.py): --allow-cluster-mismatch runs a plan for
    GPUs here and says its prediction is stale; --cluster names the cluster compile() checks
    against (a plan for other CPUs is then priced for the cluster it runs on)."""
    here = Cluster.local(2).to_dict()
    other = tmp_path / "other-cpus.json"
    other.write_text(json.dumps({**here, "name": "lab",
                                 "device": {**here["device"], "name": "cpu-some-other-model"}}))
    gpus = tmp_path / "two-gpus.json"
    gpus.write_text(json.dumps({
        "name": "two-a100-box", "device": "A100-SXM4-80GB", "devices_per_node": 2,
        "host": {"memory_bytes": 1 << 40, "device_to_host_bandwidth_bytes_per_s": 31.5e9,
                 "cpu_adam_params_per_s": 2e8},
        "node": {"components": {"socket0": "socket"},
                 "links": [{"a": ["gpu0", "gpu1"], "b": "socket0", "link": "pcie4-x16"}]}}))
    for_gpus, for_other = _plan_on(gpus, tmp_path, "gpus"), _plan_on(other, tmp_path, "other")
    capfd.readouterr()
    codes = run_ranks(_worker, 2, [for_gpus], [for_gpus, "--allow-cluster-mismatch"])
    assert codes == [[1, 0], [1, 0]]
    out = capfd.readouterr()
    assert "device kind: gpu planned, cpu here" in out.out + out.err
    assert "(the prediction is stale: made for other hardware)" in out.out
    assert run_ranks(_worker, 2, [for_other, "--cluster", str(other)]) == [[0], [0]]
    assert "stale" not in capfd.readouterr().out
    assert run_ranks(_worker, 2, [for_other]) == [[0], [0]]
    assert "(the prediction is stale: made for other hardware)" in capfd.readouterr().out


def _worker(rank, world, *argvs):
    from autoplan.errors import AutoplanError
    from autoplan.runtime import worker
    codes = []
    for plan, *rest in argvs:
        try:
            codes.append(worker.main(["--plan", plan, "--model", "gpt-tiny", "--steps", "2",
                                      *rest]))
        except AutoplanError as e:          # a worker that leaves reporting to its launcher
            print(e)
            codes.append(1)
        if dist.is_initialized():
            dist.destroy_process_group()
    return codes
