"""Nothing lost: what a run may do with a checkpoint folder (``runtime/checkpoint_dir.py``).

- Pruning keeps the step a save just wrote, and ``latest`` never names a missing step.
- A new run where another run's checkpoints are is refused (API and CLI), naming ``--resume``,
  ``--overwrite`` and another folder; ``--overwrite`` replaces them.
- ``--resume`` with nothing to resume fails before any rank starts; ``--resume-or-start``
  starts a new run.
- A crash between a save's rename and its ``latest`` update: resuming takes the newest complete
  step, and every step is still there.
- Two jobs on one folder: the second is refused while the first runs (a lock with its run id);
  once the first is gone, its stale lock is taken over.
Real training, real files and real torchrun jobs throughout.
"""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from autoplan.errors import CheckpointError
from autoplan.runtime import checkpoint as ck
from autoplan.runtime.checkpoint_dir import LOCK, claim, plan_start
from autoplan.runtime.checkpoint_files import META_FILE, complete_steps, prune, resolve
from tests.distributed import free_port
from tests.test_fault_tolerance import _export, _workers
from tests.test_checkpoint import _plan, _train


def _names(root: Path) -> list[str]:
    return [p.name for p in complete_steps(root)]


def _latest(root: Path) -> str:
    return (root / "latest").read_text().strip()


def _trainer(plan_json: str, resume=None):
    """A one-process trainer of the test plan, and its batch."""
    from autoplan.planner.planfile import Plan
    from autoplan.runtime.trainer import compile
    from tests.test_checkpoint import GLOBAL_BATCH, _example, _optimizer
    ex, small = _example(GLOBAL_BATCH), _example(1)
    trainer = compile(ex.model, "local", example_inputs=small.example_inputs,
                      example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_optimizer,
                      global_batch_size=GLOBAL_BATCH, plan=Plan.from_json(plan_json),
                      resume=resume)
    return trainer, tuple(ex.example_inputs) + (ex.targets,)


def test_a_new_run_is_refused_where_another_runs_checkpoints_are(tmp_path):
    """The issue's case through the API (one process): run A saved steps 3-5; a new run B
    saving there is refused and changes nothing; with overwrite=True it replaces them, and
    pruning keeps B's steps (it used to keep A's higher numbers and delete B's)."""
    plan = _plan(1, dict(tp=1)).to_json()
    root = tmp_path / "ckpt"
    a, batch = _trainer(plan)
    for step in range(1, 6):
        a.step(batch)
        if step >= 3:
            a.save(root)
    assert _names(root) == ["step-00000003", "step-00000004", "step-00000005"]
    b, batch = _trainer(plan)
    b.step(batch)
    with pytest.raises(CheckpointError, match=r"another run \(steps 3, 4, 5\).*--resume.*"
                                              r"--overwrite.*another --checkpoint-dir"):
        b.save(root)
    assert _names(root) == ["step-00000003", "step-00000004", "step-00000005"]
    assert _latest(root) == "step-00000005"
    b.save(root, overwrite=True)
    b.step(batch)
    b.save(root)
    assert _names(root) == ["step-00000001", "step-00000002"]
    assert _latest(root) == "step-00000002" and resolve(root).name == "step-00000002"


def test_pruning_never_deletes_the_step_just_written(tmp_path):
    """Pruning on a folder an older autoplan left with a foreign run's higher steps beside
    the one just written: that one stays, with the highest others up to keep_last."""
    root = tmp_path / "ckpt"
    for step in (100, 110, 120, 20):
        d = root / f"step-{step:08d}"
        d.mkdir(parents=True)
        (d / META_FILE).write_text("{}")
    (root / "step-00000130").mkdir()                  # no description: not a checkpoint
    gone = prune(root, keep_last=3, just_written=root / "step-00000020")
    assert [p.name for p in gone] == ["step-00000100"]
    assert _names(root) == ["step-00000020", "step-00000110", "step-00000120"]
    assert not list(root.glob(".*.deleting"))
    prune(root, keep_last=1, just_written=root / "step-00000020")
    assert _names(root) == ["step-00000020"]


def test_a_crash_between_the_rename_and_latest_loses_nothing(tmp_path, monkeypatch):
    """Step 2 is renamed into place, then writing ``latest`` fails (the state a crash there
    leaves: ``latest`` names step 1). Resuming takes step 2, the same run goes on bitwise, and
    its next save prunes nothing it should keep."""
    plan = _plan(1, dict(tp=1)).to_json()
    root = tmp_path / "ckpt"
    _, full, _ = _train(0, 1, plan, str(tmp_path / "full"), steps=4)
    _train(0, 1, plan, str(root), steps=1, save_at=1)
    real = ck.write_atomic

    def no_latest(path, text):
        if Path(path).name == "latest":
            raise OSError("killed before latest was written")
        real(path, text)
    monkeypatch.setattr(ck, "write_atomic", no_latest)
    with pytest.raises(OSError, match="killed before latest"):
        _train(0, 1, plan, str(root), steps=1, save_at=2, resume=str(root))
    monkeypatch.setattr(ck, "write_atomic", real)
    assert _latest(root) == "step-00000001"
    assert _names(root) == ["step-00000001", "step-00000002"]
    assert resolve(root).name == "step-00000002"
    start, losses, _ = _train(0, 1, plan, str(root), steps=2, save_at=4, resume=str(root))
    assert start == 2 and losses == full[2:]
    assert _names(root) == ["step-00000001", "step-00000002", "step-00000004"]
    assert _latest(root) == "step-00000004"


def test_a_run_resumed_from_an_older_step_does_not_replace_later_ones(tmp_path):
    """Resumed from step 1 of a folder that holds steps 1-3, saving there would overwrite
    steps 2 and 3: refused, or with overwrite, those two are deleted and latest is step 1's."""
    plan = _plan(1, dict(tp=1)).to_json()
    root = tmp_path / "ckpt"
    a, batch = _trainer(plan)
    for _ in range(3):
        a.step(batch)
        a.save(root)
    b, batch = _trainer(plan, resume=str(root / "step-00000001"))
    b.step(batch)
    with pytest.raises(CheckpointError, match=r"resumed from step-00000001.*later steps 2, 3"):
        b.save(root)
    assert _names(root) == ["step-00000001", "step-00000002", "step-00000003"]
    gone = claim(root, resumed_from=root / "step-00000001", overwrite=True)
    assert [p.name for p in gone] == ["step-00000002", "step-00000003"]
    assert _names(root) == ["step-00000001"] and _latest(root) == "step-00000001"


def test_plan_start_answers_without_changing_anything(tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="--resume: no checkpoint.*--resume-or-start"):
        plan_start(root, resume=True)
    start = plan_start(root, resume=True, resume_or_start=True)
    assert start.resume_from is None and "starting a new run" in start.note
    with pytest.raises(CheckpointError, match="pass one of the two"):
        plan_start(root, resume=True, overwrite=True)
    assert not root.exists()


# ---- the CLI: real torchrun jobs ----------------------------------------------------------------

def _autoplan(*args: str) -> list[str]:
    return [sys.executable, "-m", "autoplan.cli.main", *args]


ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def plan_path(gpt_tiny_two_rank_plan_path):
    return gpt_tiny_two_rank_plan_path


def _run(plan_path: str, ckpt: Path, *extra: str, steps: int = 30) -> subprocess.CompletedProcess:
    return subprocess.run(_autoplan("run", plan_path, "--model", "gpt-tiny", "--steps", str(steps),
                                    "--checkpoint-dir", str(ckpt), "--master-port",
                                    str(free_port()), *extra),
                          capture_output=True, text=True, env=ENV, timeout=600)


def test_cli_refuses_overwrites_and_resumes_as_told(plan_path, tmp_path, capsys):
    # --resume-or-start where nothing is: starts a new run (run A of what follows)
    ckpt = tmp_path / "ckpt"
    a = _run(plan_path, ckpt, "--checkpoint-every", "10", "--resume-or-start")
    assert a.returncode == 0, a.stderr[-3000:]
    assert "starting a new run" in a.stdout
    assert _names(ckpt) == ["step-00000010", "step-00000020", "step-00000030"]
    assert not (ckpt / LOCK).exists()                       # released at the end

    # a new run without --resume: refused before any rank starts, nothing touched
    b = _run(plan_path, ckpt, "--checkpoint-every", "10", steps=20)
    assert b.returncode == 1
    err = b.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for word in ("another run", "--resume", "--overwrite", "another --checkpoint-dir"):
        assert word in err, err
    assert "step " not in b.stdout
    assert _names(ckpt) == ["step-00000010", "step-00000020", "step-00000030"]

    # --overwrite: the new run's steps 10 and 20, latest 20, and export reads it
    c = _run(plan_path, ckpt, "--checkpoint-every", "10", "--overwrite", steps=20)
    assert c.returncode == 0, c.stderr[-3000:]
    assert "deleting the checkpoints of steps 10, 20, 30" in c.stdout
    assert _names(ckpt) == ["step-00000010", "step-00000020"] and _latest(ckpt) == "step-00000020"
    capsys.readouterr()
    rc = _export(ckpt, tmp_path / "m.pt")
    out, err = capsys.readouterr()
    assert rc == 0 and "at step 20" in out, err[-2000:]

    # --resume where there is nothing: one message, no rank started, nothing made
    empty = tmp_path / "empty"
    d = _run(plan_path, empty, "--resume", steps=2)
    assert d.returncode == 1 and "--resume-or-start" in d.stderr and "step " not in d.stdout
    assert len(d.stderr.strip().splitlines()) == 1, d.stderr
    assert not empty.exists()


def test_two_jobs_on_one_folder(plan_path, tmp_path):
    """Job A trains (holding the folder); job B on the same folder is refused, naming A, even
    with --resume; A's checkpoints are untouched. After A is killed, its lock is stale and a
    --resume takes the folder over and continues A's run."""
    ckpt = tmp_path / "ckpt"
    a = subprocess.Popen(_autoplan("run", plan_path, "--model", "gpt-tiny", "--steps", "100000",
                                   "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
                                   "--master-port", str(free_port())),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                         start_new_session=True)
    guard = threading.Timer(600, lambda: os.killpg(a.pid, signal.SIGKILL))
    guard.daemon = True
    guard.start()
    lines = []
    try:
        for line in a.stdout:
            lines.append(line)
            if line.startswith("checkpoint "):
                break
        assert (ckpt / LOCK).exists(), "".join(lines[-20:])
        b = _run(plan_path, ckpt, "--resume", "--checkpoint-every", "5", steps=10)
        assert b.returncode == 1, b.stdout[-2000:]
        assert "another job is writing checkpoints" in b.stderr and "step " not in b.stdout
        assert len(b.stderr.strip().splitlines()) == 1, b.stderr
    finally:
        guard.cancel()
        ranks = _workers(a.pid)              # in sessions of their own: killed one by one
        os.killpg(a.pid, signal.SIGKILL)     # the launcher first: it cannot release the lock
        for pid in ranks.values():
            os.kill(pid, signal.SIGKILL)
        a.wait()
    assert (ckpt / LOCK).exists()                      # A died holding it
    steps = [int(n[5:]) for n in _names(ckpt)]
    assert steps and all(n % 5 == 0 for n in steps)    # A's checkpoints only, B wrote none
    newest = resolve(ckpt).name
    c = _run(plan_path, ckpt, "--resume", steps=int(newest[5:]) + 2)
    assert c.returncode == 0, c.stderr[-3000:]
    assert f"resumed from {ckpt} at step {int(newest[5:])}" in c.stdout
