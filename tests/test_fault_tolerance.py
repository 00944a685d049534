"""A rank killed with SIGKILL mid-run: `autoplan run --max-restarts 2 --checkpoint-dir D` (a real
torchrun) restarts the job from the last checkpoint, and it finishes with the same final
parameters as an uninterrupted run (bitwise, compared through `autoplan export`)."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import torch

from autoplan.models import build_example
from tests.distributed import free_port

# the kill lands after step 30 and before the save of step 40 (a rank that ran on to 40 first
# would resume from there); the run then redoes steps 21-30 and goes on to the end
STEPS, EVERY, KILL_AFTER = 60, 20, 30


def _autoplan(*args, **kw):
    return [sys.executable, "-m", "autoplan.cli.main", *args]


def _workers(root_pid: int) -> dict[int, int]:
    """rank -> pid of the worker processes below ``root_pid``."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = {}, [root_pid]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            todo.append(c)
            try:
                cmd = Path(f"/proc/{c}/cmdline").read_bytes()
                env = Path(f"/proc/{c}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"autoplan.runtime.worker" in cmd:
                rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
                if rank is not None:
                    out[rank] = c
    return out


def _export(ckpt: Path, out: Path) -> int:
    """``autoplan export CKPT -o OUT`` in this process (the CLI's own parser and command: a
    subprocess would only add its interpreter's and torch's start-up, 3 s)."""
    from autoplan.cli.main import main
    return main(["export", str(ckpt), "-o", str(out)])


def _final_state(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    assert _export(ckpt, out) == 0
    return torch.load(out, weights_only=True)


def test_killed_rank_restarts_from_the_last_checkpoint(tmp_path, gpt_tiny_two_rank_plan_path):
    plan_path = gpt_tiny_two_rank_plan_path
    # a restarted attempt whose gloo rendezvous hangs exits after 60 s and is restarted
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "AUTOPLAN_COLLECTIVE_TIMEOUT_S": "60"}

    def run(ckpt: Path, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            _autoplan("run", str(plan_path), "--model", "gpt-tiny", "--steps", str(STEPS),
                      "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY),
                      "--master-port", str(free_port()), *extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True)

    clean = run(tmp_path / "clean")
    out_clean, _ = clean.communicate(timeout=600)
    assert clean.returncode == 0, out_clean[-3000:]

    # two restarts allowed: on a loaded machine a restarted attempt's gloo rendezvous has
    # timed out once (connection refused between the new workers); the next attempt resumes
    faulty = run(tmp_path / "faulty", "--max-restarts", "2")
    lines, killed = [], None
    # the job must end on its own; if it hangs, this stops it so the test fails with its log
    guard = threading.Timer(600, lambda: os.killpg(faulty.pid, signal.SIGKILL))
    guard.daemon = True
    guard.start()
    try:
        for line in faulty.stdout:
            lines.append(line)
            if killed is None and line.startswith(f"step {KILL_AFTER:3d}"):
                ranks = _workers(faulty.pid)
                assert 1 in ranks, (ranks, "".join(lines[-20:]))
                killed = ranks[1]
                os.kill(killed, signal.SIGKILL)
        faulty.wait(timeout=600)
    finally:
        guard.cancel()
        if faulty.poll() is None:
            os.killpg(faulty.pid, signal.SIGKILL)
    text = "".join(lines)
    assert killed is not None, text[-3000:]
    assert faulty.returncode == 0, text[-3000:]
    assert f"resumed from {tmp_path / 'faulty'} at step {KILL_AFTER - KILL_AFTER % EVERY}" \
        in text, text[-3000:]
    a = _final_state(tmp_path / "clean", tmp_path / "clean.pt")
    b = _final_state(tmp_path / "faulty", tmp_path / "faulty.pt")
    assert set(a) == set(b) and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_export_loads_into_the_unparallelized_model(tmp_path):
    """The consolidated state dict (safetensors) of a tp2 checkpoint loads into the plain
    model with every key, tied weights included, and equals the gathered parameters."""
    from tests.test_checkpoint import _plan, _run
    plan = _plan(2, dict(tp=2, sequence_parallel=True))
    ckpt = tmp_path / "ckpt"
    results = _run(2, plan.to_json(), str(ckpt), steps=2, save_at=2)
    assert _export(ckpt, tmp_path / "m.safetensors") == 0
    from safetensors.torch import load_file
    sd = load_file(str(tmp_path / "m.safetensors"))
    model = build_example("gpt-tiny", batch_size=1, seed=1, num_layers=4, num_heads=2).model
    model.load_state_dict(sd, strict=True)
    gathered = results[0][2]
    for k, v in model.state_dict().items():
        assert torch.equal(v, torch.tensor(gathered[k], dtype=v.dtype).reshape(v.shape)), k
