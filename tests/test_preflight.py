"""`autoplan run` checks the plan against the model, the cluster and the world size in one
process before it launches torchrun (``cli/preflight.py``): each mistake is one typed message
and exit 1, and no rank starts (the launcher is replaced by one that fails the test if called).
Ranks that do fail are reported once (``run_cmd.summarize``), with a real torchrun job and with
torchrun's own failure records."""

import json
import os
import re
import subprocess
import sys

import pytest

from autoplan import Cluster
from autoplan import plan as make_plan
from autoplan.cli import run_cmd
from autoplan.cli.main import main
from autoplan.graph import trace
from autoplan.models import build_example
from tests.conftest import has_transformers
from tests.distributed import free_port


def _plan(tmp_path, name, cluster, *, layers=None, **kw):
    small = build_example(name, batch_size=1, seed=0, device="cpu",
                          **({"num_layers": layers} if layers and name == "gpt-tiny" else
                             {"layers": layers} if layers else {}))
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets,
              name=name)
    plan = make_plan(g, cluster, global_batch_size=8, precision="fp32", profile=None, **kw)
    path = tmp_path / f"{name}.plan.json"
    plan.save(str(path))
    return str(path)


@pytest.fixture
def no_launch(monkeypatch):
    """``autoplan run`` may not start torchrun: the test fails if it tries."""
    def launch(cmd, **kw):
        raise AssertionError(f"torchrun was started: {cmd}")
    monkeypatch.setattr(run_cmd, "launch_torchrun", launch)


def _refused(capsys, *argv):
    assert main(["run", *argv, "--steps", "2"]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autoplan run: error: "), err
    assert "Traceback" not in err and "step " not in out
    return lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _plan(tmp_path_factory.mktemp("tiny"), "gpt-tiny", Cluster.local(2),
                 force=dict(tp=2))


def test_a_plan_for_another_model_names_it(tiny, capsys, no_launch):
    msg = _refused(capsys, tiny, "--model", "mlp-tiny")
    assert "made for model 'gpt-tiny'" in msg and "--model gpt-tiny" in msg


@pytest.mark.skipif(not has_transformers(), reason="needs transformers")
def test_a_forgotten_layers_says_layers(tmp_path, capsys, no_launch):
    """The issue's case: planned with --layers 3, run without it (the example's default is
    2). It used to name an internal class (HFCall) after every rank had started."""
    path = _plan(tmp_path, "hf-gpt2-lm-tiny", Cluster.local(2), layers=3)
    msg = _refused(capsys, path, "--model", "hf-gpt2-lm-tiny")
    assert "Run with --layers 3" in msg and "HFCall" not in msg, msg
    msg = _refused(capsys, path, "--model", "hf-gpt2-lm-tiny", "--layers", "4")
    assert "Run with --layers 3" in msg and "(--layers 4)" in msg, msg


def test_a_world_size_that_differs_is_refused(tiny, capsys, no_launch):
    msg = _refused(capsys, tiny, "--model", "gpt-tiny", "--nproc-per-node", "4")
    assert "needs 2 ranks" in msg and "makes 4" in msg and "drop --nproc-per-node" in msg
    msg = _refused(capsys, tiny, "--model", "gpt-tiny", "--nnodes", "2")
    assert "--nnodes 2 does not match" in msg


def test_a_plan_for_other_hardware_is_refused(tmp_path, capsys, no_launch):
    """A plan for one 8-GPU H100 node, run on this machine's 8 CPU ranks."""
    path = _plan(tmp_path, "gpt-tiny", Cluster.preset("dgx-h100", 1))
    msg = _refused(capsys, path, "--model", "gpt-tiny")
    assert "dgx-h100" in msg and "re-plan" in msg.lower(), msg


def test_arguments_and_checkpoint_folder_are_checked_first(tiny, tmp_path, capsys, no_launch):
    msg = _refused(capsys, tiny, "--model", "gpt-tiny", "--resume")
    assert "--resume need" in msg and "--checkpoint-dir" in msg
    msg = _refused(capsys, tiny, "--model", "gpt-tiny", "--checkpoint-dir",
                   str(tmp_path / "none"), "--resume")
    assert "--resume-or-start" in msg


def test_a_plan_that_fits_reaches_the_launcher(tiny, capsys, monkeypatch):
    """The same checks let a right launch through, with the command a rank runs."""
    seen = []
    monkeypatch.setattr(run_cmd, "launch_torchrun", lambda cmd, **kw: seen.append(cmd) or 0)
    assert main(["run", tiny, "--model", "gpt-tiny", "--steps", "2"]) == 0
    assert len(seen) == 1 and "autoplan.runtime.worker" in seen[0]
    assert "--nproc-per-node=2" in seen[0] and "--run-id" in seen[0]


# ---- rank failures, once ----------------------------------------------------------------------

def test_ranks_failing_alike_are_reported_once(tmp_path):
    """A plan every rank refuses (tensor-parallel overlap, which this runtime cannot run) under
    a real torchrun: one line naming both ranks, no traceback, exit 1."""
    path = _plan(tmp_path, "gpt-tiny", Cluster.local(2),
                 force=dict(tp=2, sequence_parallel=True, tp_comm_overlap=True))
    r = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "run", path, "--model",
                        "gpt-tiny", "--steps", "2", "--master-port", str(free_port())],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    # the refusal once, no traceback; a rank torchrun stopped before it refused too (the first
    # rank's exit is quick, so on a loaded machine its peer may not reach the check) is the
    # one line after it
    assert "tp_comm_overlap" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert sum("tp_comm_overlap" in line for line in lines) == 1, r.stderr
    if lines[0].endswith("(ranks 0, 1)"):
        assert len(lines) == 1, r.stderr
    else:
        assert re.search(r"\(rank [01]\)$", lines[0]) and len(lines) == 2, r.stderr
        assert re.fullmatch(r"  rank [01] failed too \(the first: killed by signal SIG\w+\)",
                            lines[1]), r.stderr


def _failure(tmp_path, rank, exitcode, data=None):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    path = tmp_path / f"error{rank}.json"
    if data is not None:
        path.write_text(json.dumps(data))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file=str(path))


def _record(rank, typed, kind, error, time_s, stack="Traceback (most recent call last): ..."):
    return {"message": {"message": f"{kind}: {error}",
                        "extraInfo": {"py_callstack": stack, "timestamp": str(int(time_s))}},
            "autoplan": {"rank": rank, "typed": typed, "type": kind, "error": error,
                         "time_s": time_s}}


def test_summary_names_the_cause_once(tmp_path):
    """torchrun's failure records of four ranks: rank 1 raised a CheckpointError, rank 0 lost
    its peer after it, rank 2 the same CheckpointError, rank 3 was killed by torchrun. One
    line for the cause with the ranks it hit, one for the rest; no traceback."""
    failures = {
        0: _failure(tmp_path, 0, 1, _record(0, False, "RuntimeError", "Connection closed by "
                                            "peer", 100.2)),
        1: _failure(tmp_path, 1, 1, _record(1, True, "CheckpointError", "disk full", 100.1)),
        2: _failure(tmp_path, 2, 1, _record(2, True, "CheckpointError", "disk full", 100.3)),
        3: _failure(tmp_path, 3, -15),
    }
    text = run_cmd.summarize(failures)
    assert text.splitlines() == [
        "autoplan run: error: disk full (ranks 1, 2)",
        "  ranks 0, 3 failed too (the first: RuntimeError: Connection closed by peer)"]
    only = run_cmd.summarize({0: _failure(tmp_path, 0, 1, _record(
        0, False, "ValueError", "bad", 5.0, stack="Traceback ...\nValueError: bad")),
        1: _failure(tmp_path, 1, 1, _record(1, False, "ValueError", "bad", 5.1))})
    assert only.count("Traceback") == 1
    assert only.splitlines()[-1] == "autoplan run: error: ValueError: bad (ranks 0, 1)"
