"""The README's main job end to end: `autoplan demo` (4 CPU ranks under a real torchrun); and
`autoplan run` building the model its plan was made for."""

import subprocess
import sys


def test_demo_plans_trains_and_plans_gpt3(tmp_path):
    """`autoplan demo`, every step of it, at the suite's size: 2 ranks instead of 4, 4 steps
    instead of 10, and GPT-3 175B traced with 8 layers (--quick) instead of 96. The options
    change counts only; the full-depth GPT-3 plan on 1,024 A100 is tests/test_planner.py's
    test_dgx_a100_gets_tensor_parallel_in_node_and_pipeline_across_nodes."""
    out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "demo", "--out",
                          str(tmp_path), "--ranks", "2", "--steps", "4", "--quick"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    losses = [float(line.split()[3]) for line in text.splitlines() if line.startswith("step ")]
    assert len(losses) == 6 and losses[-1] < losses[0]           # the loss goes down
    assert "resumed from" in text and "at step 4" in text         # and goes on after a resume
    assert "2 CPU ranks" in text and "8 layers traced" in text
    assert (tmp_path / "checkpoints" / "latest").exists()
    assert "measured step time" in text and "predicted" in text
    assert "gpt3-175b" in text and "solver" in text
    assert (tmp_path / "gpt-small-cpu.plan.json").exists()
    assert (tmp_path / "gpt3-175b.plan.json").exists()


def test_run_builds_the_model_the_plan_was_made_for(tmp_path, capsys):
    """`plan --layers N` and `run --layers N` set the example's own layer field (HF configs
    call it ``layers``, the project's ``num_layers``), and run hands it to every worker."""
    from autoplan.cli.main import main
    from autoplan.models.registry import layer_overrides
    assert layer_overrides("gpt-tiny", 4) == {"num_layers": 4}
    assert layer_overrides("hf-gpt2-lm-tiny", 4) == {"layers": 4}
    assert layer_overrides("hf-gpt2-lm-tiny", None) == {}
    path = str(tmp_path / "p.json")
    assert main(["plan", "hf-gpt2-lm-tiny", "--layers", "3", "--cluster", "local:2",
                 "--global-batch", "4", "-q", "-o", path]) == 0
    capsys.readouterr()
    assert main(["run", path, "--model", "hf-gpt2-lm-tiny", "--layers", "3", "--seq-len", "16",
                 "--print-command"]) == 0
    cmd = capsys.readouterr().out
    assert "autoplan.runtime.worker" in cmd and "--layers 3 --seq-len 16" in cmd


def test_max_positions_is_refused_where_the_example_has_no_position_table(capsys):
    """``--max-positions`` lengthens a learned (or HF rotary) position table; llama3-* compute
    theirs for any --seq-len: the option is refused with the fix, never dropped silently."""
    from autoplan.cli.main import main
    args = ["estimate", "--cluster", "dgx-h100:1", "--global-batch", "8", "--dp", "8",
            "--seq-len", "512", "--max-positions", "512", "--layers", "1"]
    assert main([*args[:1], "llama3-8b", *args[1:]]) == 1
    assert "drop --max-positions" in capsys.readouterr().err
    assert main([*args[:1], "gpt2-small", *args[1:]]) == 0
