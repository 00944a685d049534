"""The examples do what their docstrings say: examples/train_mlp_single.py's losses are a plan's
under `autoplan run`'s defaults, and examples/export_meta.py prints the graph the planner works
from. (examples/hf_architectures.py: tests/test_quiet.py.)"""

import contextlib
import importlib.util
import io
import pathlib
import re
import sys

import pytest

from tests.distributed import run_ranks

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str, argv: list[str], monkeypatch) -> str:
    monkeypatch.setattr(sys, "argv", [name] + argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _example(name).main()
    return out.getvalue()


def _train_under_a_plan(rank, world, steps):
    """What `autoplan run PLAN --model gpt-tiny` does on each rank (runtime/worker.py), with a
    tp=2 plan made here."""
    import torch
    import torch.distributed as dist

    import autoplan
    from autoplan.models import build_example
    dist.init_process_group("gloo")
    ex = build_example("gpt-tiny", batch_size=8)
    trainer = autoplan.compile(ex.model, "local", example_inputs=ex.example_inputs,
                               example_targets=ex.targets, loss_fn=ex.loss_fn,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                               global_batch_size=8, precision="fp32", force={"tp": 2})
    batch = tuple(ex.example_inputs) + (ex.targets,)
    return [float(trainer.step(batch)) for _ in range(steps)]


def test_the_single_process_example_gives_a_plans_losses(monkeypatch):
    text = _run("train_mlp_single", ["--model", "gpt-tiny", "--steps", "5", "--batch-size", "8"],
                monkeypatch)
    single = [float(x) for x in re.findall(r"loss ([\d.]+)", text)]
    assert len(single) == 5 and single[-1] < single[0]
    planned = run_ranks(_train_under_a_plan, 2, 5)
    for losses in planned:
        assert losses == pytest.approx(single, rel=1e-5)
    # the losses its docstring quotes
    quoted = re.search(r"\(5\.5669, .*\)", _example("train_mlp_single").__doc__).group(0)
    assert [f"{x:.4f}" for x in single] == quoted.strip("()").split(", ")


def test_export_meta_prints_the_planners_graph(monkeypatch):
    text = _run("export_meta", ["gpt3-175b", "--num-layers", "2"], monkeypatch)
    assert "4,278,534,144 parameters" in text
    assert "ops by kind" in text and "loss 1" in text          # traced with its loss
    assert "repeated block 'layers' (Block): 2 instances" in text
    assert "aten.linear.default" in text
