"""Golden plans: what the planner writes for a fixed set of models and clusters, byte for byte,
and what the estimator predicts for fixed configurations, to 12 significant digits.

A refactor of the planner, the estimator or the sharding rules must leave both unchanged; a
change meant to change them regenerates the files and says so in its commit:

    python tests/test_golden_plans.py --update

Clusters are presets (datasheet figures and the profiles shipped in ``profiles/``), never
``local``: this machine's own calibration would make the files depend on where they were made.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"

# name -> `autoplan plan` arguments (the model on the meta device, as the CLI builds it)
PLANS = {
    "gpt-tiny-h100x8": ["gpt-tiny", "--cluster", "dgx-h100:1", "--global-batch", "16"],
    "llama-tiny-cp2-h100x16": ["llama-tiny", "--cluster", "dgx-h100:2", "--global-batch", "16",
                               "--seq-len", "256", "--force", "cp=2"],
    "mixtral-ep2-a100x8": ["hf-mixtral-tiny", "--cluster", "dgx-a100-80gb:1",
                           "--global-batch", "16", "--force", "ep=2"],
    "titan-moe-pp2-h100x16": ["titan-moe-tiny", "--cluster", "dgx-h100:2", "--global-batch",
                              "32", "--force", "pp=2"],
    "resnet-tiny-h100x8": ["resnet-tiny", "--cluster", "dgx-h100:1", "--global-batch", "64"],
    "llama3-8b-4layers-h100x64": ["llama3-8b", "--layers", "4", "--cluster", "dgx-h100:8",
                                  "--global-batch", "256", "--seq-len", "4096"],
}

# name -> (example, cluster preset, nodes, global batch, ParallelConfig fields)
ESTIMATES = {
    "gpt3-175b-8layers-megatron": ("gpt3-175b", "dgx-a100-80gb", 16, 256,
                                   dict(tp=8, pp=4, dp=4, micro_batch_size=1,
                                        schedule="interleaved_1f1b", virtual_stages=2,
                                        sequence_parallel=True, recompute="selective",
                                        zero_stage=1)),
    "llama3-8b-zero3": ("llama3-8b", "dgx-h100", 8, 256,
                        dict(dp=64, micro_batch_size=2, zero_stage=3)),
    "gpt3-1.3b-zero-bubble": ("gpt3-1.3b", "dgx-h100", 1, 64,
                              dict(pp=4, dp=2, micro_batch_size=2, schedule="zero_bubble",
                                   virtual_stages=2)),
}
ESTIMATE_LAYERS = {"gpt3-175b": 8}


def _plan_bytes(name: str, tmp: Path) -> bytes:
    from autoplan.cli.main import main
    out = tmp / f"{name}.plan.json"
    assert main(["plan", *PLANS[name], "-q", "-o", str(out)]) == 0
    return out.read_bytes()


def _estimate_figures(name: str) -> dict[str, str]:
    import autoplan
    from autoplan.models.registry import build_example
    example, preset, nodes, gbs, fields = ESTIMATES[name]
    layers = {"num_layers": ESTIMATE_LAYERS[example]} if example in ESTIMATE_LAYERS else {}
    ex = build_example(example, device="meta", **layers)
    graph = autoplan.trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)
    e = autoplan.estimate(graph, autoplan.Cluster.preset(preset, nodes=nodes),
                          config=autoplan.ParallelConfig(**fields), global_batch_size=gbs)
    t = e.time
    return {k: f"{v:.12g}" for k, v in {
        "step_time_s": e.step_time_s, "peak_memory_bytes": e.peak_memory_bytes,
        "compute_s": t.compute_s, "bubble_s": t.bubble_s, "recompute_s": t.recompute_s,
        "optimizer_s": t.optimizer_s, **{f"comm_exposed_s.{k}": v
                                         for k, v in sorted(t.comm_exposed_s.items())},
    }.items()}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plans_are_the_golden_ones(name, tmp_path):
    golden = GOLDEN / f"{name}.plan.json"
    assert _plan_bytes(name, tmp_path) == golden.read_bytes(), (
        f"the plan for {name} changed; if meant, regenerate: python {__file__} --update")


def test_estimates_are_the_golden_ones():
    golden = json.loads((GOLDEN / "estimates.json").read_text())
    assert {name: _estimate_figures(name) for name in sorted(ESTIMATES)} == golden


def _update() -> None:
    import tempfile
    GOLDEN.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(PLANS):
            (GOLDEN / f"{name}.plan.json").write_bytes(_plan_bytes(name, Path(tmp)))
    (GOLDEN / "estimates.json").write_text(json.dumps(
        {name: _estimate_figures(name) for name in sorted(ESTIMATES)}, indent=1) + "\n")
    print(f"wrote {len(PLANS)} plans and {len(ESTIMATES)} estimates under {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        raise SystemExit(f"usage: python {sys.argv[0]} --update")
    _update()
