"""autoplan's predictions of the measured one-GPU speed rows, eager and compiled, beside them.

    python benchmarks/gpu_predictions.py        # anywhere (CPU): plans on the measured card's preset

Issue 36 item 5: time within 10 % and memory never under for every model of the GPU check,
compiled and eager. The measured rows are the committed ``speed.json`` of a GPU check
(``benchmarks/gpu_check.py``: ms per step and peak allocated bytes, 8 x 2048 tokens, bf16, one
GPU); each is planned again here, on the preset of the card it ran on (``hgx-h200/1``) with the
plan the check ran (its micro-batch, compiled or not), so a change of the cost model shows
against what was measured without a GPU. Plain eager PyTorch's and ``torch.compile``'s rows are
printed beside for reference; autoplan predicts its own program.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPEED = HERE / "data" / "h200-gpu-check-20261127" / "speed.json"
PRESETS = {"NVIDIA H200": "hgx-h200/1", "NVIDIA H100 80GB HBM3": "hgx-h100/1"}


@dataclass(frozen=True)
class Row:
    model: str
    variant: str                 # "autoplan eager" or "autoplan compiled"
    measured_s: float
    measured_peak_bytes: float
    predicted_s: float
    predicted_peak_bytes: float
    plain_s: float | None        # the same model in plain eager PyTorch or torch.compile

    @property
    def time_error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0


def _graph(label: str):
    sys.path.insert(0, str(HERE))
    import gpu_check
    from autoplan.graph import trace
    from autoplan.models import build_example
    name, over, gbs, mbs = gpu_check._speed_models(small=False)[label]
    meta = build_example(name, batch_size=1, device="meta", **over)
    return trace(meta.model, meta.example_inputs, loss_fn=meta.loss_fn,
                 targets=meta.targets), gbs, mbs


def predictions(path: Path = SPEED) -> list[Row]:
    """One row per (model, autoplan variant) of the measured file, planned again now."""
    from autoplan import Cluster, plan
    data = json.loads(path.read_text())
    cluster = Cluster.from_spec(PRESETS[data["device"]])
    rows = []
    for result in data["results"]:
        graph, gbs, mbs = _graph(result["model"])
        for variant, plain in (("autoplan eager", "eager"),
                               ("autoplan compiled", "torch.compile")):
            measured = result[variant]
            p = plan(graph, cluster, global_batch_size=gbs, precision="bf16", max_pp=1,
                     force=dict(micro_batch_size=mbs, compiled=variant.endswith("compiled")))
            rows.append(Row(model=result["model"], variant=variant,
                            measured_s=measured["step_s"],
                            measured_peak_bytes=measured["peak_bytes"],
                            predicted_s=p.predicted["step_time_s"],
                            predicted_peak_bytes=p.predicted["peak_memory_bytes"],
                            plain_s=result.get(plain, {}).get("step_s")))
    return rows


def table(rows: Sequence[Row], path: Path = SPEED) -> list[str]:
    lines = [f"measured: {path.relative_to(HERE.parent) if path.is_relative_to(HERE.parent) else path}",
             "", "| model | autoplan | measured ms | predicted ms | error | measured GiB | "
             "predicted GiB | plain PyTorch ms (eager / torch.compile) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.variant.split()[1]} | {r.measured_s * 1e3:.1f} | "
                     f"{r.predicted_s * 1e3:.1f} | {r.time_error * 100:+.1f} % | "
                     f"{r.measured_peak_bytes / 2**30:.2f} | {r.predicted_peak_bytes / 2**30:.2f} | "
                     f"{'' if r.plain_s is None else f'{r.plain_s * 1e3:.1f}'} |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("speed", nargs="?", default=str(SPEED),
                    help="a GPU check's speed.json (default: the committed H200 one)")
    args = ap.parse_args(argv)
    path = Path(args.speed).resolve()
    print("\n".join(table(predictions(path), path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
