"""The README's main job end to end: `autoplan demo` (4 CPU ranks under a real torchrun)."""

import subprocess
import sys


def test_demo_plans_trains_and_plans_gpt3(tmp_path):
    out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "demo", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    losses = [float(line.split()[3]) for line in text.splitlines() if line.startswith("step ")]
    assert len(losses) == 15 and losses[-1] < losses[0]          # the loss goes down
    assert "resumed from" in text and "at step 10" in text        # and goes on after a resume
    assert (tmp_path / "checkpoints" / "latest").exists()
    assert "measured step time" in text and "predicted" in text
    assert "gpt3-175b" in text and "solver" in text
    assert (tmp_path / "gpt-small-cpu.plan.json").exists()
    assert (tmp_path / "gpt3-175b.plan.json").exists()
