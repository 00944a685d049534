"""The sharding-rule registry: rules registered by op family, matmul-likes from one einsum
rule, and the runtime's kernels registered under the names the strategies use."""

import pytest

from autoplan.graph import trace
from autoplan.graph.products import ProductSpec, product_names
from autoplan.models import build_example
from autoplan.runtime.program_calls import KERNEL_CALLS
from autoplan.sharding import registry
from autoplan.sharding.strategies import strategies


def test_every_declared_kernel_has_a_runtime_and_every_runtime_a_declaration():
    declared = set(registry.KERNELS) - {""}
    registered = set(KERNEL_CALLS)
    assert declared - registered == set(), "kernels strategies name that the runtime lacks"
    assert registered - declared == set(), "runtime kernels no strategy declares"


@pytest.mark.parametrize("name", ["gpt-tiny", "cnn-tiny", "titan-moe-tiny", "dlrm-tiny"])
def test_every_kernel_a_strategy_names_is_registered(name):
    ex = build_example(name, batch_size=4, seed=0)
    g = trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    named = {s.kernel for op in g.ops for s in strategies(g, op, 2)} - {""}
    assert named and named <= set(KERNEL_CALLS)


def test_a_rule_registers_once_per_op():
    with pytest.raises(ValueError, match="two sharding rules"):
        registry.register_op_strategy("layer_norm")(lambda graph, op, t: [])
    with pytest.raises(ValueError, match="declared twice"):
        registry.declare_kernel("sp_linear", "something else")


def test_every_product_has_the_one_rule():
    rules = {registry.rule_for(_FakeOp(n)) for n in product_names()}
    assert len(rules) == 1 and None not in rules
    assert {"linear", "addmm", "mm", "bmm", "baddbmm", "matmul", "einsum",
            "_grouped_mm"} <= product_names()


class _FakeOp:
    def __init__(self, name):
        self.target = f"aten.{name}.default"


def test_einsum_dims_by_class():
    d = ProductSpec(0, "bmk", 1, "bkn", "bmn").dims()
    assert (d.batch, d.lhs_free, d.rhs_free, d.contracted) == (("b",), ("m",), ("n",), ("k",))
    g = ProductSpec(0, "mk", 1, "ekn", "mn", offsets=2, grouped="e").dims()
    assert g.grouped == ("e",) and g.contracted == ("k",) and g.rhs_free == ("n",)


def test_search_code_never_branches_on_op_names():
    """planner/ and estimate/ read op families (kind, the registry's properties), never aten
    names."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1] / "autoplan"
    pattern = re.compile(r'"aten\.|\.target ==|\.target\.startswith|startswith\("aten|'
                         r'opname\(op\) (not )?in |opname\(op\) ==')
    hits = [f"{p.relative_to(root)}:{i}: {line.strip()}"
            for sub in ("planner", "estimate") for p in sorted((root / sub).glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)


def test_an_einsum_with_a_weight_gets_the_strategies_of_a_linear():
    """``einsum("bsd,fd->bsf", x, W)`` is a linear layer written as an einsum: the one rule
    gives it Megatron's splits, placed on the einsum's own dims (not the variants whose
    kernels read a linear's call)."""
    import torch

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 4))
            self.lin = torch.nn.Linear(4, 8, bias=False)

        def forward(self, x):
            return torch.einsum("bsd,fd->bsf", x, self.w) + self.lin(x)
    x = torch.randn(2, 4, 4)
    g = trace(Both(), (x,), loss_fn=lambda out, t: out.sum(), targets=torch.zeros(2))
    by_target = {op.target.split(".")[1]: op for op in g.ops}
    ein, lin = by_target["einsum"], by_target["linear"]
    got = {s.name: (s.inputs[1], s.outputs) for s in strategies(g, ein, 2)}
    want = {s.name: (s.inputs[1], s.outputs) for s in strategies(g, lin, 2)}
    assert set(got) == {"replicate", "colwise", "rowwise", "batch", "seq"}
    assert got == {k: v for k, v in want.items() if k in got}
    assert {"colwise_sp", "seq_gathered"} <= set(want)
