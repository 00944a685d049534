"""Elastic re-planning (``autoplan run --elastic``, ``planner/replan.py``, ``runtime/elastic.py``).

The planner half: a warm start keeps the last plan's layout family and re-solves dp; a world the
family does not divide falls back to a full search; a global batch no plan of the new world can
keep becomes the nearest, stated. The runtime half, on gloo: four elastic agents (one rank each,
c10d rendezvous on localhost) train; one agent and its rank are killed; the job re-forms on the
nodes left, re-plans, resumes from the latest checkpoint, and its losses are those of one
uninterrupted single-process run on the same samples (the global batch is kept)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.errors import ConfigError
from autoplan.graph import trace
from autoplan.models import build_example
from autoplan.planner.replan import (even_shares, nearest_batch, neighbourhood, replan,
                                     warm_force)
from autoplan.sharding.parallel_config import ParallelConfig
from tests.distributed import free_port

GBS, STEPS, EVERY, KILL_AT, WARMUP, LR = 12, 14, 2, 4, 4, 3e-3


@pytest.fixture(scope="module")
def tiny_graph():
    small = build_example("gpt-tiny", batch_size=1, seed=0)
    return trace(small.model, small.example_inputs, loss_fn=small.loss_fn,
                 targets=small.targets, name="gpt-tiny")


@pytest.fixture(scope="module")
def tiny_llama():
    small = build_example("llama-tiny", batch_size=1, seed=0)
    return trace(small.model, small.example_inputs, loss_fn=small.loss_fn,
                 targets=small.targets, name="llama-tiny")


def test_warm_force_keeps_the_family_and_derives_dp():
    last = ParallelConfig(dp=8, tp=2, pp=4, schedule="interleaved_1f1b", virtual_stages=2,
                          sequence_parallel=True, precision="bf16", zero_stage=1)
    force = warm_force(last, 48)
    assert force["dp"] == 6 and force["tp"] == 2 and force["pp"] == 4
    assert force["schedule"] == "interleaved_1f1b" and force["virtual_stages"] == 2
    assert force["sequence_parallel"] is True and "zero_stage" not in force
    assert warm_force(last, 36) is None            # tp x pp = 8 does not divide 36
    assert [nearest_batch(16, d) for d in (14, 7, 5, 32)] == [14, 14, 15, 32]
    assert nearest_batch(21, 14) == 28             # a tie goes to the larger


def test_neighbourhood_of_a_mesh():
    """tp and cp halved, kept, doubled (tp inside a node); per (tp, cp) the pipeline degrees
    nearest the last whose dp splits the world and the batch, each stage with a micro-batch."""
    last = ParallelConfig(dp=16, cp=4, tp=1, zero_stage=3)
    # Llama-3-8B's 64-GPU plan on 56 GPUs, batch 16: every dp without a pipeline is a multiple
    # of 7, so pipelines of 7 (cp 2 at tp 1 would need pp 7 at dp 4: 4 micro-batches for
    # 7 stages)
    assert neighbourhood(last, 56, 16, 32, 8) == (
        (7, 1, 4, 2), (7, 1, 8, 1), (7, 2, 2, 2), (7, 2, 4, 1))
    # 32 GPUs: the last pp (1) works at every cp; the nearest pipeline above it too
    assert (1, 16, 2, 1) in neighbourhood(last, 32, 16, 32, 8)
    assert (2, 4, 4, 1) in neighbourhood(last, 32, 16, 32, 8)
    # tp 2 does not fit nodes of one device; 5 devices split a batch of 12 no way
    assert neighbourhood(ParallelConfig(dp=2, tp=2), 5, 12, 2, 1) == ()
    assert even_shares(8, 3) == (3, 3, 2) and even_shares(16, 14) == (2, 2) + (1,) * 12


def test_warm_start_picks_the_best_of_its_neighbourhood(tiny_llama):
    """The warm start's plan is the fastest of the full search forced to each mesh of its
    neighbourhood in turn (the same machinery, one search over them all)."""
    eight = make_plan(tiny_llama, Cluster.local(2, nodes=4), global_batch_size=GBS,
                      precision="fp32", profile=None, force=dict(dp=4, tp=2, zero_stage=1))
    four = Cluster.local(2, nodes=2)
    meshes = neighbourhood(eight.config, 4, GBS, 2, 2)
    assert len(meshes) >= 4 and (1, 2, 1, 2) in meshes
    warm = replan(tiny_llama, four, last=eight.config, global_batch_size=GBS)
    assert warm.how == "warm start" and warm.batch_kept
    each = []
    for pp, dp, cp, tp in meshes:
        try:
            each.append(make_plan(tiny_llama, four, global_batch_size=GBS, precision="fp32",
                                  profile=None, baselines=False,
                                  force=dict(pp=pp, dp=dp, cp=cp, tp=tp)))
        except ConfigError:
            continue              # no plan on that mesh (a cp the model cannot take)
    best = min(each, key=lambda p: p.predicted["step_time_s"])
    assert warm.plan.predicted["step_time_s"] == pytest.approx(best.predicted["step_time_s"],
                                                               rel=1e-9)
    c = warm.plan.config
    assert (c.pp, c.dp, c.cp, c.tp) in meshes and c.dp_shares is None


def test_replan_warm_start_full_search_and_nearest_batch(tiny_graph):
    four = make_plan(tiny_graph, Cluster.local(4), global_batch_size=GBS, precision="fp32",
                     profile=None, force=dict(dp=2, tp=2, zero_stage=1))
    # 2 devices: a neighbour of dp 2 tp 2, the batch kept, the numerics kept
    warm = replan(tiny_graph, Cluster.local(2), last=four.config, global_batch_size=GBS)
    assert warm.how == "warm start" and warm.batch_kept and not warm.batch_note
    assert warm.plan.config.world_size == 2 and warm.plan.config.precision == "fp32"
    # 3 nodes of one device: tp 2 does not fit a node; tp 1 with dp 3 keeps the batch
    three = replan(tiny_graph, Cluster.local(1, nodes=3), last=four.config,
                   global_batch_size=GBS)
    assert three.how == "warm start" and three.batch_kept
    assert (three.plan.config.dp, three.plan.config.tp) == (3, 1)
    # 5 nodes of one device: only dp 5 (tp stays in a node, pp 5 > 2 layers), which 12 is no
    # multiple of, and the last layout (tp 2) does not divide 5 for uneven shares: the full
    # search, then the nearest multiple, 10, stated
    five = replan(tiny_graph, Cluster.local(1, nodes=5), last=four.config,
                  global_batch_size=GBS)
    assert not five.batch_kept and five.plan.training.global_batch_size == 10
    assert "cannot be kept" in five.batch_note and "10" in five.batch_note


def test_replan_nearest_batch_keeps_the_layout_where_asked(tiny_graph):
    """On 3 devices a dp-4 plan's layout (dp 3) cannot split a batch of 8 evenly: "keep" runs
    it with uneven shares (3, 3, 2 micro-batches), "nearest" keeps dp and takes 9."""
    four = make_plan(tiny_graph, Cluster.local(4), global_batch_size=8, precision="fp32",
                     profile=None, force=dict(dp=4, tp=1, zero_stage=1))
    keep = replan(tiny_graph, Cluster.local(3), last=four.config, global_batch_size=8)
    assert keep.how == "warm start" and keep.batch_kept
    assert keep.plan.config.dp == 3 and keep.plan.config.dp_shares == (3, 3, 2)
    assert keep.plan.config.microbatches(8) == 3
    near = replan(tiny_graph, Cluster.local(3), last=four.config, global_batch_size=8,
                  batch="nearest")
    assert near.how == "warm start" and near.plan.config.dp == 3
    assert near.plan.training.global_batch_size == 9 and "using 9" in near.batch_note
    with pytest.raises(ConfigError, match="keep"):
        replan(tiny_graph, Cluster.local(3), last=four.config, global_batch_size=8,
               batch="most")


def test_plan_for_world_keeps_a_fitting_plan_and_reports_a_change(tiny_graph):
    """The plan file's plan where it is for the world; else a re-plan, and the four lines rank 0
    prints (world, plan, predicted step, batch and data position)."""
    from autoplan.runtime.elastic import LastRun, last_run, plan_for_world, plan_digest
    four = make_plan(tiny_graph, Cluster.local(1, nodes=4), global_batch_size=GBS,
                     precision="fp32", profile=None, force=dict(dp=4, tp=1, zero_stage=1))
    same = plan_for_world(four, last_run(four, None), graph=tiny_graph,
                          cluster=Cluster.local(1, nodes=4))
    assert same.plan is four and same.report == ()
    last = LastRun(config=four.config, world=4, batch=GBS, predicted_step_s=0.0125,
                   samples_seen=48)
    three = plan_for_world(four, last, graph=tiny_graph, cluster=Cluster.local(1, nodes=3))
    world, plan_line, step, batch = three.report
    assert world.startswith("elastic: world 4 -> 3 devices (re-planned by warm start in ")
    assert plan_line == (f"elastic: plan {four.config.short()} -> "
                         f"{three.plan.config.short()}") and three.plan.config.dp == 3
    assert step.startswith("elastic: predicted step 12.5 ms -> ")
    assert batch == f"elastic: global batch {GBS} kept; resuming at sample 48"
    assert plan_digest(three.plan) != plan_digest(four)


@pytest.mark.parametrize("argv, says", [
    (["--nnodes", "2:4"], "add --elastic"),
    (["--rdzv-conf", "last_call_timeout=1"], "--rdzv-conf configure an elastic job"),
    (["--elastic-batch", "nearest"], "--elastic-batch configure an elastic job"),
    (["--elastic", "--nnodes", "4:2"], "1 <= MIN <= MAX"),
    (["--elastic", "--nnodes", "two"], "--nnodes takes a count N, or MIN:MAX"),
])
def test_run_refuses_elastic_options_that_do_not_go_together(capsys, argv, says):
    """Refused before the plan is read or any rank starts: one line, what to do."""
    from autoplan.cli.main import main
    assert main(["run", "no-such.plan.json", "--model", "gpt-tiny", *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def _plan_for_four_nodes(path: Path, graph) -> None:
    """gpt-tiny on four one-CPU nodes: dp 4, ZeRO-1, fp32, global batch 12."""
    p = make_plan(graph, Cluster.local(1, nodes=4), global_batch_size=GBS, precision="fp32",
                  profile=None, force=dict(dp=4, tp=1, zero_stage=1))
    p.save(str(path))


def _elastic_command(plan: Path, ckpt: Path, port: int, capsys) -> tuple[dict, list[str]]:
    """The torchrun command `autoplan run --elastic --print-command` prints: (env, argv)."""
    from autoplan.cli.main import main
    assert main(["run", str(plan), "--model", "gpt-tiny", "--elastic", "--nnodes", "2:4",
                 "--nproc-per-node", "1", "--max-restarts", "2", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", str(EVERY), "--steps", str(STEPS), "--lr", str(LR),
                 "--warmup-steps", str(WARMUP), "--master-port", str(port), "--rdzv-conf",
                 "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=2",
                 "--print-command"]) == 0
    words = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-")
               and "/" not in w.split("=", 1)[0])
    argv = [w for w in words if w not in {f"{k}={v}" for k, v in env.items()}]
    return env, argv


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _reference_losses() -> list[float]:
    """One process, plain PyTorch: the samples of the stream, AdamW with the warm-up."""
    from autoplan.runtime.elastic import POOL_BATCHES, SampleStream
    torch.manual_seed(0)
    ex = build_example("gpt-tiny", batch_size=GBS * POOL_BATCHES, seed=0)
    stream = SampleStream(tuple(ex.example_inputs) + (ex.targets,))
    opt = torch.optim.AdamW(ex.model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1 / WARMUP, total_iters=WARMUP)
    losses = []
    for step in range(STEPS):
        *inputs, targets = stream.batch(step * GBS, GBS)
        loss = ex.loss_fn(ex.model(*inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_a_lost_node_replans_and_the_losses_continue(tmp_path, tiny_graph, capsys):
    plan, ckpt, out = tmp_path / "plan.json", tmp_path / "ckpt", tmp_path / "losses.json"
    _plan_for_four_nodes(plan, tiny_graph)
    env, argv = _elastic_command(plan, ckpt, free_port(), capsys)
    env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "AUTOPLAN_COLLECTIVE_TIMEOUT_S": "30"}
    logs = [tmp_path / f"agent{i}.log" for i in range(4)]
    agents = []
    try:
        for log in logs:           # four nodes of one rank each; the first hosts the rendezvous
            agents.append(subprocess.Popen(argv + ["--json", str(out)], env=env,
                                           stdout=log.open("w"), stderr=subprocess.STDOUT,
                                           start_new_session=True))
            time.sleep(0.3)
        deadline = time.monotonic() + 300
        while not (ckpt / "latest").exists() or \
                (ckpt / "latest").read_text().strip() < f"step-{KILL_AT:08d}":
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), \
                "\n".join(log.read_text()[-2000:] for log in logs)
            time.sleep(0.05)
        victim = agents[-1]        # a node that does not host the rendezvous: it and its rank
        for pid in _children(victim.pid):
            os.kill(pid, signal.SIGKILL)
        victim.kill()
        for a in agents[:-1]:
            a.wait(timeout=300)
    finally:
        for a in agents:
            if a.poll() is None:
                for pid in _children(a.pid):
                    os.kill(pid, signal.SIGKILL)
                a.kill()
    text = "\n".join(log.read_text() for log in logs[:-1])
    assert all(a.returncode == 0 for a in agents[:-1]), text[-4000:]
    world = next(int(line.split("->")[1].split()[0]) for line in text.splitlines()
                 if line.startswith("elastic: world 4 ->"))
    assert world in (2, 3), text[-4000:]
    assert f"elastic: plan dp4 tp1 pp1 mbs1 zero1 fp32 -> dp{world} " in text, text[-4000:]
    assert "elastic: predicted step" in text and f"global batch {GBS} kept" in text
    # the losses: the first attempt's as printed (4 decimals), the last attempt's exact
    printed = {}
    for line in text.splitlines():
        if line.startswith("step ") and " loss " in line:
            printed[int(line.split()[1])] = float(line.split()[3])
    last = json.loads(out.read_text())
    ref = _reference_losses()
    assert last["first_step"] >= KILL_AT and len(last["losses"]) == STEPS - last["first_step"]
    torch.testing.assert_close(torch.tensor(last["losses"]),
                               torch.tensor(ref[last["first_step"]:]), rtol=1e-5, atol=1e-6)
    assert set(printed) == set(range(STEPS))
    for step, loss in printed.items():
        assert abs(loss - ref[step]) <= 6e-5, (step, loss, ref[step])
