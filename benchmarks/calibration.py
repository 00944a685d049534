"""Calibrate this machine, then hold plans to it: predicted vs measured step time.

    python benchmarks/calibration.py              # gpt-small-cpu, 4 families on 2 and 4 ranks
    python benchmarks/calibration.py --model gpt-tiny --steps 6

Uses a private profile folder (nothing of yours is touched): first the plan of the first family
runs under `autoplan calibrate` (which writes the refit profile), then every family is planned
again on the calibrated machine and trained with `autoplan run`; each prints its median step
time next to the prediction. Also prints what the uncalibrated figures (the placeholders a CPU
without a profile would get) predicted. Goal: measured/predicted within 15 %; ranks that
outnumber the cores (4 on 2) are priced by their share of the machine.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

FAMILIES = [(2, ["tp=1", "zero_stage=0"], "dp2"), (2, ["tp=2"], "tp2"),
            (4, ["tp=1", "zero_stage=3"], "dp4 FSDP (4 ranks on the cores)"),
            (4, ["tp=2", "dp=2"], "dp2 x tp2")]


def _autoplan(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", *args], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"autoplan {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def _plan(model: str, world: int, force: list[str], path: str, env: dict[str, str]) -> None:
    forced = [x for f in force for x in ("--force", f)]
    _autoplan("plan", model, "--cluster", f"local:{world}", "--global-batch", str(4 * world),
              "--precision", "fp32", "--max-pp", "1", *forced, "-o", path, env=env)


def _run(model: str, path: str, steps: int, env: dict[str, str]) -> tuple[float, float]:
    text = _autoplan("run", path, "--model", model, "--steps", str(steps), env=env)
    m = re.search(r"measured step time ([\d.]+) ms \(median\), predicted ([\d.]+) ms", text)
    if not m:
        raise SystemExit(f"no step time in:\n{text[-1500:]}")
    return float(m.group(1)), float(m.group(2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-small-cpu")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="autoplan-calbench-") as tmp:
        env = {**os.environ, "AUTOPLAN_PROFILE_DIR": os.path.join(tmp, "profiles"),
               "AUTOPLAN_AUTO_CALIBRATE": "0", "PYTHONWARNINGS": "ignore"}
        rows = []
        for world, force, label in FAMILIES:          # the placeholders' predictions
            path = os.path.join(tmp, f"raw-{world}-{len(rows)}.json")
            _plan(args.model, world, force, path, env)
            rows.append(_run(args.model, path, args.steps, env))
        first = os.path.join(tmp, "calibrate.json")
        _plan(args.model, FAMILIES[1][0], FAMILIES[1][1], first, env)
        print(_autoplan("calibrate", first, "--model", args.model, env=env))
        print(f"{'family':<36} {'uncalibrated':>22} {'calibrated':>34}")
        print(f"{'':<36} {'measured/predicted':>22} {'measured  predicted  ratio':>34}")
        worst = 0.0
        for (world, force, label), raw in zip(FAMILIES, rows):
            path = os.path.join(tmp, f"cal-{world}-{label[:4]}.json")
            _plan(args.model, world, force, path, env)
            measured, predicted = _run(args.model, path, args.steps, env)
            ratio = measured / predicted
            worst = max(worst, abs(ratio - 1))
            print(f"{label:<36} {raw[0] / raw[1]:>22.2f} {measured:>9.1f} ms {predicted:>7.1f} ms "
                  f"{ratio:>6.2f}")
        print(f"worst calibrated error {worst * 100:.0f} % (goal: 15 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
