"""Heterogeneous plans run (issue 40 item 1, the runtime half): on a mixed CPU cluster (two pools
of two CPU ranks whose devices differ 3x in peak rate and whose NICs differ,
examples/mixed-cpu.yaml), `autoplan plan` writes a runnable plan file, `inspect` says which
pool each stage or replica runs on, and `autoplan run` under a real torchrun (gloo, 4 ranks as
2+2) trains (a) pp2 with uneven layers per stage and (b) dp4 with uneven micro-batches per
replica to one device's losses. The plan file's format, its matching to the same pools only
and the refusal elsewhere are checked without launching."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autoplan import Cluster
from autoplan.cli.main import main
from autoplan.errors import PlanError
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.hetero import plan_hetero
from autoplan.planner.hetero_planfile import hetero_plan
from autoplan.planner.planfile import Plan, plan_mismatch
from tests.distributed import free_port

MIXED = str(Path(__file__).resolve().parents[1] / "examples" / "mixed-cpu.yaml")
GBS, LAYERS, STEPS, LR = 8, 4, 3, 3e-3


def _plan_cli(tmp_path, capsys, name, *force):
    out = tmp_path / f"{name}.json"
    assert main(["plan", "gpt-tiny", "--layers", str(LAYERS), "--cluster", MIXED,
                 "--global-batch", str(GBS), "--precision", "fp32", "--no-profile", "-q",
                 *[x for f in force for x in ("--force", f)], "-o", str(out)]) == 0
    capsys.readouterr()
    return out, Plan.from_json(out.read_text())


@pytest.fixture(scope="module")
def graph():
    ex = build_example("gpt-tiny", batch_size=1, num_layers=LAYERS)
    return trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets,
                 name="gpt-tiny")


def _one_device():
    """The worker's model and batch (seeded as every rank builds them), trained on one
    process: the full batch per step, AdamW at the run's learning rate."""
    ex = build_example("gpt-tiny", batch_size=GBS, seed=0, device="cpu", num_layers=LAYERS)
    opt = torch.optim.AdamW(ex.model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = ex.loss_fn(ex.model(*ex.example_inputs), ex.targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run(plan_path, tmp_path, name, model=("gpt-tiny", "--layers", str(LAYERS))):
    """`autoplan run` as a user types it (torchrun, 4 CPU ranks, gloo); rank 0's losses."""
    losses = tmp_path / f"{name}.losses.json"
    out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "run", str(plan_path),
                          "--model", *model, "--cluster", MIXED,
                          "--steps", str(STEPS), "--lr", str(LR), "--master-port",
                          str(free_port()), "--json", str(losses)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(losses.read_text())["losses"], out.stdout


def test_plans_on_pools_run_as_one_device(tmp_path, capsys):
    """(a) the planner's pipeline: the faster pool's stage takes more layers; (b) data
    parallelism forced (pp 1): the faster pool's replicas take more micro-batches. Each runs
    under torchrun to the losses of one process on the same samples."""
    piped, pp = _plan_cli(tmp_path, capsys, "pp")
    assert pp.hetero["placement"] == "stages" and pp.config.pp == 2
    assert [u["pool"] for u in pp.hetero["units"]] == [0, 1]
    slow, fast = (u["layers"] for u in pp.hetero["units"])
    assert fast > slow and list(pp.config.chunk_layers) == [slow, fast]
    assert [len(s["layers"]) for s in pp.stages] == [slow, fast]
    shared, dp = _plan_cli(tmp_path, capsys, "dp", "pp=1")
    assert dp.hetero["placement"] == "replicas" and dp.config.dp == 4
    shares = dp.config.dp_shares
    assert shares[0] == shares[1] < shares[2] == shares[3]
    assert [u["microbatches"] for u in dp.hetero["units"]] == list(shares)
    for plan in (pp, dp):            # never slower than the cluster as its slowest GPU
        assert plan.predicted["step_time_s"] <= plan.hetero["slowest_gpu"]["step_time_s"]
    assert main(["inspect", str(piped)]) == 0
    text = capsys.readouterr().out
    assert f"stage 1 (ranks 2-3) on pool 1: {fast} layer(s)" in text
    assert "the cluster as its slowest GPU (4 x cpu-slow)" in text and "gain" in text
    want = _one_device()
    for path, name in ((piped, "pp"), (shared, "dp")):
        got, out = _run(path, tmp_path, name)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6), name
        assert "on pools: " in out


def test_the_plan_matches_the_same_pools_only(graph, tmp_path):
    """Round trip byte for byte and valid under the shipped schema; the same pools match, a CPU
    job of the same size runs it (stale); on GPU pools another order, or the same devices with
    another NIC, is refused naming the pools on both sides."""
    cluster = Cluster.from_spec(MIXED)
    result = plan_hetero(graph, cluster, global_batch_size=GBS, precision="fp32", profile=None)
    plan = result.to_plan(graph, cluster, global_batch_size=GBS, precision="fp32",
                          profile=None)
    assert Plan.from_json(plan.to_json()).to_json() == plan.to_json()
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).resolve().parents[1] / "autoplan" / "planner"
                         / "plan.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(json.loads(plan.to_json()))
    assert plan.schema_version == 9 and plan.pool_of_rank(3)["name"] == "cpu-fast"
    assert plan_mismatch(plan, graph=graph, cluster=cluster) == ""
    # a homogeneous CPU job of the same size runs it, its prediction stale (CPU ranks)
    assert plan_mismatch(plan, cluster=Cluster.local(4)) == ""
    gpus = Cluster.from_spec("dgx-a100-80gb/1:2+dgx-h100/1:2")
    gplan = replace(plan, cluster=type(plan.cluster).of(gpus))
    swapped = Cluster.from_spec("dgx-h100/1:2+dgx-a100-80gb/1:2")
    said = plan_mismatch(gplan, cluster=swapped)
    assert "pools: [pool 0: 2 nodes x 1 A100" in said and "--allow-cluster-mismatch" in said
    nics = Cluster.from_dict({"name": "nics", "pools": [
        {"preset": "dgx-a100-80gb/1", "num_nodes": 2, "fabric": {"link": "ib-ndr"}},
        {"preset": "dgx-h100/1", "num_nodes": 2}]})
    said = plan_mismatch(gplan, cluster=nics)
    assert "NIC ib-hdr; pool 1" in said and "NIC ib-ndr; pool 1" in said


def test_bad_hetero_sections_are_refused_by_path(graph):
    cluster = Cluster.from_spec(MIXED)
    result = plan_hetero(graph, cluster, global_batch_size=GBS, precision="fp32", profile=None,
                         force={"pp": 1})
    d = json.loads(hetero_plan(result, graph, cluster, global_batch_size=GBS,
                               precision="fp32", profile=None).to_json())
    for mutate, said in (
            (lambda d: d["hetero"]["units"][0].update(microbatches=7), "hetero.units[0]"),
            (lambda d: d["hetero"]["units"][2]["ranks"].append(0), "not in pool 1"),
            (lambda d: d["hetero"]["pools"][1].update(first_rank=3), "first_rank"),
            (lambda d: d.update(schema_version=8), "schema 9"),
            (lambda d: d.pop("hetero"), "neither")):
        bad = json.loads(json.dumps(d))
        mutate(bad)
        with pytest.raises(PlanError, match=said.replace("[", r"\[").replace("]", r"\]")):
            Plan.from_dict(bad)


def test_pictures_draw_every_pool(tmp_path, capsys):
    """`cluster show --png` and `inspect --topology` on pools: every pool's first node drawn as
    its own node type and labelled with its device (SVG text kept as text to read it back)."""
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.rcParams["svg.fonttype"] = "none"
    svg = tmp_path / "gpus.svg"
    assert main(["cluster", "show", "dgx-a100-80gb:4+dgx-h100:4", "--png", str(svg)]) == 0
    assert "nodes drawn in detail: 0, 1, 4, 7" in capsys.readouterr().out
    text = svg.read_text()
    assert "pool 0: A100-SXM4-80GB" in text and "pool 1: H100-SXM5-80GB" in text
    assert "nvlink3 x12" in text and "nvlink4 x18" in text       # each pool's links
    assert "2 of pool 0, each like node 0" in text
    piped, _ = _plan_cli(tmp_path, capsys, "pp")
    topo = tmp_path / "topo.svg"
    assert main(["inspect", str(piped), "--cluster", MIXED, "--topology", str(topo)]) == 0
    assert "pp      2 ranks x 2 groups" in capsys.readouterr().out
    text = topo.read_text()
    assert "pool 0: cpu-slow" in text and "pool 1: cpu-fast" in text


def test_hf_llama_in_bf16_on_uneven_replicas_runs_as_one_autocast_process(tmp_path, capsys):
    """A foreign model (HF Llama from a tiny config, use_cache off: the zoo's hf-llama-tiny) on
    the mixed cluster's dp4 plan with uneven micro-batches per replica, in bf16 (CPU autocast),
    trains to the losses of one process running it under torch.autocast("cpu", bfloat16) on
    the same samples. Tolerance rel 1e-3, a quarter of bf16's unit roundoff (2**-8): the
    replicas run 16-bit GEMMs on other row counts and sum their gradients in another order, so
    the bf16 roundings differ from the one process's; the loss itself is fp32 under autocast."""
    out = tmp_path / "llama.json"
    assert main(["plan", "hf-llama-tiny", "--cluster", MIXED, "--global-batch", str(GBS),
                 "--precision", "bf16", "--no-profile", "-q", "--force", "pp=1",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    plan = Plan.from_json(out.read_text())
    assert plan.config.precision == "bf16" and plan.hetero["placement"] == "replicas"
    shares = plan.config.dp_shares
    assert plan.config.dp == 4 and shares[0] == shares[1] < shares[2] == shares[3]
    ex = build_example("hf-llama-tiny", batch_size=GBS, seed=0, device="cpu")
    assert ex.model.model.config.use_cache is False
    opt = torch.optim.AdamW(ex.model.parameters(), lr=LR)
    want = []
    for _ in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ex.loss_fn(ex.model(*ex.example_inputs), ex.targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    got, text = _run(out, tmp_path, "llama", model=("hf-llama-tiny",))
    assert got == pytest.approx(want, rel=1e-3)
    assert "on pools: " in text
