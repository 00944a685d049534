"""`autoplan.Example.from_model(model, inputs, targets, loss_fn)`: a user's model as every command
takes it. The README's own flow (plan, run on 2 ranks, resume under another plan, export) runs
in tests/test_docs.py; here, the helper's answers and its typed refusals, and a
``package.module:function`` returning it planned and pre-flight checked by ``autoplan run``."""

import math
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import autoplan
from autoplan.errors import AutoplanError, ConfigError


def _mse(out, y):
    return nn.functional.mse_loss(out, y)


def test_from_model_fills_in_what_autoplan_needs():
    model = nn.Linear(8, 4)
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    ex = autoplan.Example.from_model(model, x, y, _mse)
    assert ex.model is model and ex.example_inputs == (x,) and ex.targets is y
    assert ex.name == "Linear" and ex.family == "user" and ex.config is None
    assert ex.compute_loss().dim() == 0
    two = autoplan.Example.from_model(nn.Bilinear(8, 8, 4), [x, x], y, _mse, name="pair")
    assert two.example_inputs == (x, x) and two.name == "pair"
    from autoplan.models import Example
    assert autoplan.Example is Example          # one class, exported at the top


@pytest.mark.parametrize("args,says", [
    ((object(), torch.randn(3, 8), torch.randn(3, 4), _mse), "torch.nn.Module"),
    ((nn.Linear(8, 4), (), torch.randn(3, 4), _mse), "at least one tensor"),
    ((nn.Linear(8, 4), "x", torch.randn(3, 4), _mse), "at least one tensor"),
    ((nn.Linear(8, 4), torch.randn(3, 8), [1, 2, 3], _mse), "targets must be a tensor"),
    ((nn.Linear(8, 4), torch.randn(3, 8), torch.randn(3, 4), "mse"), "loss_fn must be a function"),
    ((nn.Linear(8, 4), torch.randn(3, 8), torch.randn(2, 4), _mse), "(3, 8), (2, 4)"),
    ((nn.Linear(8, 4), torch.tensor(1.0), torch.tensor(1.0), _mse), "first (batch) dimension"),
])
def test_from_model_refuses_what_cannot_be_planned_with_a_typed_error(args, says):
    with pytest.raises(ConfigError, match="Example.from_model") as e:
        autoplan.Example.from_model(*args)
    assert says in str(e.value)


def test_a_function_returning_from_model_is_planned_and_checked_by_run(tmp_path, monkeypatch,
                                                                       capsys):
    """`autoplan plan mine:make` and `autoplan run PLAN --model mine:make --print-command`: the
    pre-flight builds the model as every rank will, traces it and matches it to the plan."""
    (tmp_path / "mine.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        import autoplan

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
                self.head = nn.Linear(32, 4)

            def forward(self, x):
                for layer in self.layers:
                    x = torch.relu(layer(x))
                return self.head(x)

        def make():
            x, y = torch.randn(4, 32), torch.randint(0, 4, (4,))
            return autoplan.Example.from_model(Net(), x, y, nn.functional.cross_entropy)

        def wrong():
            return "not an example"
    """))
    monkeypatch.chdir(tmp_path)
    from autoplan.cli.main import main
    assert main(["plan", "mine:make", "--cluster", "local:2", "--global-batch", "8",
                 "--precision", "fp32", "-q", "-o", "mine.plan.json"]) == 0
    capsys.readouterr()
    assert main(["run", "mine.plan.json", "--model", "mine:make", "--print-command"]) == 0
    printed = capsys.readouterr().out
    assert "--model mine:make" in printed
    assert printed.startswith("OMP_NUM_THREADS=1 PYTHONHASHSEED=0 ")   # as autoplan run's ranks
    from autoplan.models import load_user_example
    with pytest.raises(AutoplanError, match=r"Example\.from_model\(model, inputs, targets"):
        load_user_example("mine:wrong")


_COMPUTED_BUFFER = textwrap.dedent("""
    import torch
    from torch import nn
    import autoplan

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
            self.head = nn.Linear(64, 4)
            # computed in __init__: torch.device("meta") would lose it
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 64))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x)) * self.scale
            return self.head(x)

    def make():
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(4, 64, generator=g), torch.randint(0, 4, (4,), generator=g)
        return autoplan.Example.from_model(Net(), x, y, nn.functional.cross_entropy)
""")


def test_a_users_model_runs_under_meta_each_rank_allocating_its_shards(tmp_path, monkeypatch):
    """`autoplan run PLAN --model mine:make --meta`: every rank builds the user's model under
    autoplan.empty_weights() (weights on meta, the buffer __init__ computes kept), the plan
    materializes its shards, and it trains (2 gloo ranks, tp 2: each weight split)."""
    import json

    from autoplan.cli.main import main
    from autoplan.runtime.worker import build_run_model
    from tests.distributed import free_port
    (tmp_path / "mine_meta.py").write_text(_COMPUTED_BUFFER)
    monkeypatch.chdir(tmp_path)
    built = build_run_model("mine_meta:make", batch=8, meta=True)
    assert all(p.is_meta for p in built.model.parameters())
    assert all(p.is_meta for p in built.small.model.parameters())
    assert torch.equal(built.model.scale, torch.linspace(0.5, 1.5, 64))
    assert built.data.example_inputs[0].shape == (8, 64) and not built.data.targets.is_meta
    with pytest.raises(AutoplanError, match="--seq-len takes example names"):
        build_run_model("mine_meta:make", batch=8, meta=True, seq_len=16)
    assert main(["plan", "mine_meta:make", "--cluster", "local:2", "--global-batch", "8",
                 "--precision", "fp32", "--force", "tp=2", "-q", "-o", "p.json"]) == 0
    assert main(["run", "p.json", "--model", "mine_meta:make", "--meta", "--steps", "4",
                 "--json", "out.json", "--master-port", str(free_port())]) == 0
    losses = json.loads((tmp_path / "out.json").read_text())["losses"]
    assert len(losses) == 4 and all(map(math.isfinite, losses)), losses
    # one rank of a GPU preset's plan of it, emulated from meta on this CPU
    assert main(["plan", "mine_meta:make", "--cluster", "dgx-h100:1", "--global-batch", "64",
                 "--force", "tp=2", "-q", "-o", "gpu.json"]) == 0
    out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "emulate", "gpu.json",
                          "--model", "mine_meta:make", "--rank", "3", "--steps", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 3 of 8" in out.stdout, out.stdout
