"""The pieces of ``benchmarks/gpu_check.sh`` (the one prepared GPU check) on the CPU, small:
a zoo model against eager autocast, the by-hand training steps it times autoplan against, and
the table it writes. Nothing measured here is a GPU figure."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def test_a_zoo_model_is_judged_against_eager_autocast():
    r = gpu_check._zoo_model("nanogpt-tiny")
    assert r["verdict"] == "OK", r
    assert 1e-4 < r["update_error_plan"] <= 1.5 * r["update_error_eager"] + 1e-3
    assert len(r["loss_plan"]) == len(r["loss_eager"]) == 3


def test_the_by_hand_step_trains_and_is_timed():
    from autoplan.models import build_example
    ex = build_example("gpt-tiny", batch_size=4, seed=0)
    before = next(ex.model.parameters()).detach().clone()
    step_s, peak = gpu_check._timed(gpu_check._by_hand(ex, 2, compiled=False), steps=2)
    assert step_s > 0 and peak is None                   # no CUDA: no allocator figures
    assert not next(ex.model.parameters()).detach().equal(before)


def test_the_table_reads_every_part(tmp_path):
    parts = {
        "zoo": [dict(model="m", verdict="OK", update_error_plan=1e-2, update_error_eager=9e-3,
                     plan="dp1 bf16"), dict(model="x", verdict="CRASH", error="E: boom")],
        "speed": [{"model": "llama", "tokens": "8 x 2048",
                   "eager": dict(step_s=0.27, peak_bytes=44e9),
                   "torch.compile": dict(step_s=0.22, peak_bytes=36e9),
                   "autoplan eager": dict(step_s=0.27, peak_bytes=44e9, predicted_step_s=0.272,
                                          predicted_peak_bytes=46e9),
                   "autoplan compiled": dict(step_s=0.21, peak_bytes=35e9,
                                             predicted_step_s=0.23, predicted_peak_bytes=46e9)}],
        "emulate": [dict(label="llama3-8b", plan="dp8 tp8", step_s=0.5, predicted_compute_s=0.45,
                         peak_bytes=20e9, predicted_peak_bytes=22e9)],
    }
    files = []
    for name, results in parts.items():
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(dict(part=name, device="NVIDIA H200", results=results)))
        files.append(str(f))
    (tmp_path / "full-step.json").write_text(json.dumps({"step_s": 0.336}))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "table",
                          *files, str(tmp_path / "full-step.json"), "--out",
                          str(tmp_path / "all.json")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "all.md").read_text()
    assert "NVIDIA H200" in text and "| x | CRASH |" in text
    assert "| 0.955 |" in text                  # autoplan's best / torch.compile: 0.21 / 0.22
    assert "500.0 / 450.0" in text and "0.336" in text
    merged = json.loads((tmp_path / "all.json").read_text())
    assert set(merged) >= {"zoo", "speed", "emulate", "full_step"}


def test_the_speed_rows_count_the_compiled_regions_and_their_graphs():
    """What the speed part records beside an autoplan compiled step: regions of one class
    share a graph, and a region that stays eager shows as fewer graphs than region kinds
    (dynamo's eager backend: no C++ build)."""
    import torch
    model = torch.nn.Sequential(_Region(), _Region(), _Other())
    model[0].compile(backend="eager")
    model[2].compile(backend="eager")
    read = gpu_check._dynamo_graphs()
    model(torch.ones(2, 4))
    assert read(model) == dict(compiled_regions=2, region_kinds=2, graphs=2, graph_breaks=0)
    model[1].compile(backend="eager")            # its class's graph serves it
    model(torch.ones(2, 4))
    assert read(model) == dict(compiled_regions=3, region_kinds=2, graphs=2, graph_breaks=0)


class _Region(__import__("torch").nn.Module):     # dynamo skips torch's own modules' code
    def forward(self, x):
        return (x * 2).relu()


class _Other(_Region):
    def forward(self, x):
        return x + 1
