"""Quiet by default: library code logs through `logging` (the CLI's --log-level shows it),
prints nothing of its own, and the collectives raise no warning a user cannot act on; the HF
example runs at sizes where weights are split."""

import ast
import importlib.util
import logging
import pathlib
import warnings

import pytest

from autoplan.cli.main import main
from tests.conftest import has_transformers
from tests.distributed import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]

# modules whose output is the user's: (file, why)
PRINTS = {
    "runtime/worker.py": "the torchrun entry point of `autoplan run`: losses, checkpoints, errors",
    "runtime/verify.py": "the torchrun entry point of `autoplan verify`",
    "runtime/link_probe.py": "a probe process whose output its parent reads",
    "runtime/trainer.py": "rank 0's stale-prediction warning and a rank's failure to join",
}


def _prints(path: pathlib.Path) -> list[int]:
    return [n.lineno for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]


def test_library_code_prints_nothing():
    """Outside the command line and the rank processes' entry points, autoplan logs (module
    loggers) instead of printing: a program importing it decides what shows."""
    found = {}
    for f in sorted((ROOT / "autoplan").rglob("*.py")):
        rel = f.relative_to(ROOT / "autoplan").as_posix()
        if rel.startswith("cli/") or rel in PRINTS:
            continue
        lines = _prints(f)
        if lines:
            found[rel] = lines
    assert not found, f"print() in library modules (log through logging.getLogger): {found}"


def test_log_level_decides_what_the_command_line_shows(capsys):
    log = logging.getLogger("autoplan.cluster.local")
    assert main(["cluster", "show", "dgx-h100"]) == 0           # default: warnings and up
    capsys.readouterr()
    log.info("a progress note")
    log.warning("something to act on")
    err = capsys.readouterr().err
    assert "a progress note" not in err
    assert "autoplan: warning: something to act on" in err
    assert main(["--log-level", "info", "cluster", "show", "dgx-h100"]) == 0
    capsys.readouterr()
    log.info("a progress note")
    assert capsys.readouterr().err == "autoplan: a progress note\n"
    assert main(["--log-level", "DEBUG", "cluster", "show", "dgx-h100"]) == 0
    capsys.readouterr()
    log.debug("detail")
    assert capsys.readouterr().err == "autoplan: [autoplan.cluster.local] detail\n"
    main(["--log-level", "WARNING", "cluster", "show", "dgx-h100"])  # leave the default
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["--log-level", "LOUD", "cluster", "show", "dgx-h100"])
    assert "invalid choice: 'LOUD'" in capsys.readouterr().err


def _gather_and_scatter(rank, world):
    import torch
    import torch.distributed as dist

    from autoplan.runtime.tp_comm import AxisComm
    dist.init_process_group("gloo")
    comm = AxisComm(dist.group.WORLD, world, rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gathered = comm.all_gather(torch.full((3,), float(rank)))
        scattered = comm.reduce_scatter(torch.ones(world, 3))
    return gathered.tolist(), scattered.tolist(), [str(w.message) for w in seen]


def test_tensor_parallel_collectives_warn_nothing():
    """torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor with a
    FutureWarning on every rank; autoplan calls their successors where torch has them."""
    for gathered, scattered, seen in run_ranks(_gather_and_scatter, 2):
        assert gathered == [[0.0] * 3, [1.0] * 3]
        assert scattered == [2.0] * 3
        assert seen == []


@pytest.mark.skipif(not has_transformers(), reason="transformers not installed")
@pytest.mark.parametrize("name", ["gemma2", "opt"])
def test_the_hf_example_plans_split_weights(name, capfd):
    """examples/hf_architectures.py runs at sizes where the planner splits weights over tp (at
    its old hidden size of 64 it split none, and its OK checked nothing sharded), and counts
    them."""
    import torch

    from autoplan import Cluster, plan
    spec = importlib.util.spec_from_file_location("hf_example",
                                                  ROOT / "examples" / "hf_architectures.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    x = torch.randint(0, ex.VOCAB, (ex.BATCH, ex.SEQ))
    capfd.readouterr()
    model = ex.build(name)
    assert "token_id" not in capfd.readouterr().err      # transformers' config complaints
    p = plan(model, Cluster.local(2), global_batch_size=ex.BATCH, example_inputs=(x,),
             loss_fn=ex.loss_fn, targets=x, precision="fp32", force={"tp": 2})
    split = ex.sharded(p)
    assert split == sum(q.tp != "R" for q in p.param_placements.values()) >= 4
