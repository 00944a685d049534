"""fp8 linear layers and ``precision="auto"`` (issue 39, part 5): the per-linear fp8 choice
against a by-hand comparison of the priced times, the config field, the search, and the
run-time refusal."""

import pytest
import torch
from torch import nn

from autoplan.cluster.cluster import Cluster
from autoplan.cost.compute import compute_model
from autoplan.cost.float8 import Float8Setting
from autoplan.errors import ConfigError, PlanError
from autoplan.estimate.chunk_cost import CostInputs
from autoplan.estimate.float8_choice import fp8_choices, fp8_skip
from autoplan.graph import trace
from autoplan.graph.analysis import analyze
from autoplan.planner.search import plan
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.sharding.sharding import replicated


class TwoLinears(nn.Module):
    """A small linear (64 -> 64) and a big one (8,192 -> 8,192) over 8,192 rows (a sequence)."""

    def __init__(self):
        super().__init__()
        self.small = nn.Linear(64, 64, bias=False)
        self.up = nn.Linear(64, 8192, bias=False)
        self.big = nn.Linear(8192, 8192, bias=False)

    def forward(self, x):
        return self.big(self.up(self.small(x))).float().pow(2).mean()


@pytest.fixture(scope="module")
def graph():
    with torch.device("meta"):
        m = TwoLinears()
    return trace(m, (torch.randn(1, 8192, 64, device="meta"),))


def _by_hand(c16, m, n, k, *, weight_bytes, rate_ratio, launch, bw):
    """fp8 time of one linear, written out from the module doc of cost/float8.py: compiled
    casts (2h + 1 bytes per element, two kernels each; a 4-byte scale per tensor), the
    GEMM's time above its kernel's fixed part ``rate_ratio`` times faster."""
    def cast(elements, h):
        return elements * (2 * h + 1) + 4.0
    fwd_b = cast(m * k, 2) + cast(n * k, weight_bytes)
    bwd_b = 2 * cast(m * n, 2) + cast(m * k, 2) + cast(n * k, weight_bytes)
    gemm = lambda t: launch + (t - launch) / rate_ratio   # noqa: E731
    return (gemm(c16.fwd_s) + fwd_b / bw + 4 * launch) + (gemm(c16.bwd_s) + bwd_b / bw
                                                          + 8 * launch)


def test_fp8_choice_per_linear_matches_by_hand(graph):
    dev = Cluster.preset("dgx-h100").device
    # compiled, as torchao's float8 training needs for speed (its casts fused)
    cfg = ParallelConfig(fp8="tensorwise", compiled=True)
    cm = compute_model(graph, dev, "bf16", fused=True, fp8=Float8Setting.of(cfg))
    ci = CostInputs(graph=graph, analysis=analyze(graph), sharding=replicated(graph),
                    compute=cm, cluster=Cluster.preset("dgx-h100"), config=cfg)
    choices = {c.linear: c for c in fp8_choices(ci)}
    assert set(choices) == {"small", "up", "big"}
    tput = cm.tput
    for name, (m, n, k) in {"small": (8192, 64, 64), "big": (8192, 8192, 8192)}.items():
        i = next(j for j, op in enumerate(graph.ops) if op.module_path == name
                 and op.kind == "matmul")
        c16 = cm.cost16(i)
        want = _by_hand(c16, m, n, k, weight_bytes=4, rate_ratio=1978.9 / 989.4,
                        launch=tput.launch_s, bw=tput.memory_bytes_per_s)
        got = choices[name]
        assert got.sides == (m, n, k)
        assert got.bf16_s == pytest.approx(c16.fwd_s + c16.bwd_s)
        assert got.fp8_s == pytest.approx(want, rel=1e-9)
        assert got.pays == (want < c16.fwd_s + c16.bwd_s)
    assert not choices["small"].pays          # a small GEMM: the casts cost more
    assert choices["big"].pays                # a big GEMM on an H100: fp8 pays
    assert choices["big"].fp8_s < 0.75 * choices["big"].bf16_s
    assert "small" in fp8_skip(tuple(choices.values()))
    assert "big" not in fp8_skip(tuple(choices.values()))


def test_fp8_never_on_a100(graph):
    dev = Cluster.preset("dgx-a100-80gb").device
    cm = compute_model(graph, dev, "bf16", fp8=Float8Setting.of(
        ParallelConfig(fp8="tensorwise")))
    assert not cm.fp8_linears                 # no fp8 rate: nothing converts
    with pytest.raises(ConfigError, match="fp8 tensor cores"):
        plan(graph, "dgx-a100-80gb", global_batch_size=8, force={"fp8": "tensorwise"},
             max_tp=1, max_pp=1, top_k=0)
    p = plan(graph, "dgx-a100-80gb", global_batch_size=8, precision="auto", max_tp=1,
             max_pp=1, top_k=20)
    assert p.config.fp8 == "none"
    assert all(a.config.fp8 == "none" for a in p.alternatives)


def test_auto_precision_picks_fp8_on_h100_and_says_where(graph):
    from autoplan.planner.explain import explain_plan
    p = plan(graph, "dgx-h100", global_batch_size=8, precision="auto", max_tp=1, max_pp=1,
             force={"zero_stage": 0, "compiled": True}, top_k=20)
    assert p.config.fp8 in ("tensorwise", "rowwise")
    assert "small" in p.config.fp8_skip and p.config.precision == "bf16"
    assert any(a.config.fp8 == "none" for a in p.alternatives)    # compared with bf16
    rows = {r["linear"]: r for r in p.predicted["fp8_linears"]}
    assert rows["big"]["pays"] and not rows["small"]["pays"]
    text = explain_plan(p)
    assert "fp8 linear layers" in text and "big" in text
    again = type(p).from_json(p.to_json())            # the rows and fields read back
    assert again.config == p.config and again.predicted == p.predicted


def test_config_field():
    c = ParallelConfig(fp8="rowwise", fp8_skip=["layers.*.attn.k_proj"])
    assert "fp8-rowwise" in c.short()
    assert ParallelConfig.from_dict(c.to_dict()) == c
    assert "fp8" not in ParallelConfig().to_dict() and "fp8_skip" not in ParallelConfig().to_dict()
    assert not c.fp8_converts("layers.3.attn.k_proj") and c.fp8_converts("layers.3.mlp.up")
    with pytest.raises(ConfigError, match="precision='bf16'"):
        ParallelConfig(fp8="tensorwise", precision="fp32")
    with pytest.raises(ConfigError, match="fp8_skip"):
        ParallelConfig(fp8_skip=["x"])


def test_fp8_plan_refused_at_run_time_with_the_fix(graph):
    from autoplan.runtime.trainer import _refuse_unrunnable
    p = plan(graph, "dgx-h100", global_batch_size=8, force={"fp8": "tensorwise",
                                                             "zero_stage": 0},
             max_tp=1, max_pp=1, top_k=0)
    with pytest.raises(PlanError, match="--precision bf16"):
        _refuse_unrunnable(p, has_loss=False)
