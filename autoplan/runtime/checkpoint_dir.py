"""Who may write a checkpoint folder, and what a run starting there may do with what it holds.

Three rules keep checkpoints from being lost (files only: no process group here):

- **One job at a time.** A job claims the folder before it writes: ``root/.autoplan-lock``
  holds its run id, host, the pid of the process that lives as long as the job (torchrun's
  agent, or ``autoplan run`` itself; the rank process outside torchrun) and its rank 0's.
  Another job is refused while either lives (ranks orphaned by a killed agent still write).
  A restart of the same job (same run id: ``autoplan run`` hands its ranks ``--run-id``,
  which torchrun's restarts keep) takes the lock over; a lock whose processes are gone from
  this host is stale. A lock from another host cannot be checked: it is refused, naming the
  file to delete once that job is over.
- **One run per folder.** A run writes into a folder only if it resumed from the folder's
  newest checkpoint. Else its saves would mix with another run's steps (and pruning, which
  keeps the highest step numbers, would delete them: found by a user whose run wrote steps 10
  and 20 beside another run's 100-120 and lost both). Refused with a message naming
  ``--resume``, ``--overwrite`` and another folder.
- **Overwrite says which go.** With ``overwrite`` the run deletes the checkpoints it would
  contradict (all of them for a new run; those after its step for a run resumed from an older
  one) when it claims the folder, before it trains, so a restart can never resume them.

``plan_start`` answers, read-only, what a start would do (``autoplan run`` asks before it
launches ranks); ``claim`` does it (rank 0 of the job, before its first save).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from autoplan.errors import CheckpointError
from autoplan.runtime.checkpoint_files import (LATEST, write_atomic, complete_steps, remove_step,
                                               resolve, step_number)

LOCK = ".autoplan-lock"
RUN_ID_ENV = "AUTOPLAN_RUN_ID"


def run_id() -> str:
    """This job's identity: ``AUTOPLAN_RUN_ID`` (``autoplan run`` sets it for every rank and
    every restart), else this host and process."""
    return os.environ.get(RUN_ID_ENV) or f"{socket.gethostname()}:{os.getpid()}"


def _job_pid() -> int:
    """The process that lives as long as the job: torchrun's agent (a restart replaces the
    ranks, not it), else this process."""
    return os.getppid() if "TORCHELASTIC_RESTART_COUNT" in os.environ else os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_lock(root: Path) -> dict | None:
    try:
        data = json.loads((root / LOCK).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}                     # unreadable: held by someone we cannot name
    return data if isinstance(data, dict) else {}


def other_holder(root: Path, job: str) -> str | None:
    """Who else holds ``root`` (a description), or None when it is free, ours or stale."""
    lock = read_lock(root)
    if lock is None or lock.get("run_id") == job:
        return None
    pid, host = lock.get("pid"), lock.get("host")
    pids = [p for p in (pid, lock.get("rank0_pid")) if isinstance(p, int)]
    if host == socket.gethostname() and pids and not any(map(_alive, pids)):
        return None                   # that job is over: its launcher and its rank 0 are gone
    who = (f"run {lock.get('run_id')!r}, pid {pid} on host {host}, since {lock.get('since')}"
           if lock else "a lock file that cannot be read")
    return (f"another job is writing checkpoints to {root} ({who}). Wait for it to end or "
            f"choose another folder; if that job is no longer running, delete {root / LOCK}")


def acquire(root: Path, job: str) -> bool:
    """Take ``root``'s lock for ``job`` (refused while another live job holds it). True when
    this call took it, False when ``job`` held it already."""
    root.mkdir(parents=True, exist_ok=True)
    record = {"run_id": job, "host": socket.gethostname(), "pid": _job_pid(),
              "rank0_pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _ in range(3):
        lock = read_lock(root)
        if lock is not None:
            busy = other_holder(root, job)
            if busy:
                raise CheckpointError(busy)
            if lock.get("run_id") == job:      # a restart of this job, or its second claim:
                if lock.get("rank0_pid") != os.getpid():       # its rank 0 is this process
                    write_atomic(root / LOCK, json.dumps({**lock, "rank0_pid": os.getpid()}))
                return False
            (root / LOCK).unlink(missing_ok=True)     # stale: its process is gone
        try:
            fd = os.open(root / LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue                  # taken between our look and our write: look again
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(record) + "\n")
        atexit.register(release, root, job)
        return True
    raise CheckpointError(f"could not take {root / LOCK}: other jobs keep taking it")


def release(root: Path, job: str) -> None:
    """Give ``root`` back (only if ``job`` holds it)."""
    lock = read_lock(root)
    if lock is not None and lock.get("run_id") == job:
        (root / LOCK).unlink(missing_ok=True)


# ---- what a start does with the folder ---------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Start:
    """What a run starting on a checkpoint folder does."""

    resume_from: Path | None          # the step it resumes (None: a new run)
    replaces: tuple[Path, ...]        # the checkpoints its --overwrite deletes
    note: str                         # one line for the user ("" when nothing to say)


def _steps(paths: list[Path]) -> str:
    """"step 4" / "steps 10, 20, 30" / "steps 10, 20, 30, ..., 120"."""
    nums = [str(step_number(p)) for p in paths]
    text = ", ".join(nums if len(nums) <= 4 else nums[:3] + ["...", nums[-1]])
    return f"step{'s' if len(nums) > 1 else ''} {text}"


def _contradicted(root: Path, resumed_from: Path | None) -> tuple[list[Path], str]:
    """The checkpoints in ``root`` that a run resumed from ``resumed_from`` (None: a new run)
    would contradict, and why, for the refusal."""
    steps = complete_steps(root)
    if resumed_from is not None and resumed_from.resolve().parent == root.resolve():
        mine = step_number(resumed_from) or 0
        later = [p for p in steps if step_number(p) > mine]
        return later, (f"this run resumed from {resumed_from.name}, but {root} also holds the "
                       f"later {_steps(later)}, which its saves would replace")
    return steps, (f"{root} holds the checkpoints of another run ({_steps(steps)})")


def _refusal(why: str, root: Path) -> CheckpointError:
    return CheckpointError(
        f"{why}. Continue that run with --resume (compile(..., resume={str(root)!r})), replace "
        f"its checkpoints with --overwrite (trainer.save(..., overwrite=True): they are "
        f"deleted), or write this run's into another --checkpoint-dir")


def plan_start(root: str | os.PathLike[str], *, resume: bool = False,
               resume_or_start: bool = False, overwrite: bool = False,
               job: str | None = None) -> Start:
    """What a run started on ``root`` does, checked without changing anything: the step it
    resumes (``resume``: the newest, or a CheckpointError when there is none, unless
    ``resume_or_start``), and the checkpoints ``overwrite`` would delete. Refused: another
    live job holding the folder; a new run where another run's checkpoints are."""
    root = Path(root)
    if overwrite and (resume or resume_or_start):
        raise CheckpointError("--overwrite starts a new run and deletes the checkpoints in "
                              f"{root}; --resume continues from them: pass one of the two")
    busy = other_holder(root, job or run_id())
    if busy:
        raise CheckpointError(busy)
    resume_from, note = None, ""
    if resume or resume_or_start:
        try:
            resume_from = resolve(root)
        except CheckpointError as e:
            if not resume_or_start:
                raise CheckpointError(f"--resume: {e}. Nothing is started; pass "
                                      "--resume-or-start to start a new run when there is no "
                                      "checkpoint to resume") from None
            note = f"no checkpoint to resume in {root}: starting a new run (--resume-or-start)"
    gone, why = _contradicted(root, resume_from)
    if gone and not overwrite:
        raise _refusal(why, root)
    if gone:
        note = f"--overwrite: deleting the checkpoints of {_steps(gone)} in {root}"
    return Start(resume_from=resume_from, replaces=tuple(gone), note=note)


def claim(root: str | os.PathLike[str], *, resumed_from: Path | None, overwrite: bool = False,
          job: str | None = None) -> list[Path]:
    """Take ``root`` for a run resumed from ``resumed_from`` (None: a new run) and, with
    ``overwrite``, delete the checkpoints it contradicts (returned). Refusals as
    ``plan_start``'s."""
    root = Path(root)
    job = job or run_id()
    took = acquire(root, job)
    gone, why = _contradicted(root, resumed_from)
    if gone and not overwrite:
        if took:
            release(root, job)
        raise _refusal(why, root)
    for step in gone:
        remove_step(step)
    latest = root / LATEST
    if gone and latest.exists():
        if resumed_from is not None and resumed_from.parent.resolve() == root.resolve():
            write_atomic(latest, resumed_from.name + "\n")
        else:
            latest.unlink()
    return gone
