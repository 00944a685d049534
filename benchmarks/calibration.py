"""Calibrate this machine, then hold plans to it: predicted vs measured step time.

    python benchmarks/calibration.py              # gpt-small-cpu, 4 families on 2 and 4 ranks
    python benchmarks/calibration.py --model gpt-tiny --steps 6

Uses private profile folders (nothing of yours is touched) and a CPU name without a shipped
profile (``$AUTOPLAN_CPU_NAME``), so any machine is a new one. Every family is planned and trained
with `autoplan run` (median step time next to the prediction) three times:
- on placeholders (AUTOPLAN_AUTO_CALIBRATE=0, no profile: what a CPU gets with nothing measured);
- at first use: the first plan calibrates this CPU automatically (a few seconds), as on a new
  machine; goal within 25 %;
- after `autoplan calibrate` on the dp2 and tp2 plans (which refits the profile); goal within
  15 %.
Ranks that outnumber the cores (4 on 2) are priced by their share of the machine.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

# Each family runs one micro-batch per step (global batch 4 per rank): the same program in all
# three columns, whatever figures the planner had (with the micro-batch size free, the planner
# picks the size its figures make cheapest, and the comparison would mix models and programs).
FAMILIES = [(2, ["tp=1", "zero_stage=0", "micro_batch_size=4"], "dp2"),
            (2, ["tp=2", "micro_batch_size=8"], "tp2"),
            (4, ["tp=1", "zero_stage=3", "micro_batch_size=4"], "dp4 FSDP (4 ranks on the cores)"),
            (4, ["tp=2", "dp=2", "micro_batch_size=8"], "dp2 x tp2")]


def _autoplan(*args: str, env: dict[str, str]) -> str:
    # --log-level INFO: the first use's calibration note, read below
    out = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "--log-level", "INFO",
                          *args], env=env, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise SystemExit(f"autoplan {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    for line in out.stderr.splitlines():      # the first use's figures
        if line.startswith("autoplan: calibrated in"):
            print(line, flush=True)
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
        # a CPU name no profile is shipped for: this machine is treated as a new one (its own
        # shipped profile, if any, would otherwise answer in every column)
        base = {**os.environ, "PYTHONWARNINGS": "ignore",
                "AUTOPLAN_CPU_NAME": "calibration benchmark CPU"}
        raw_env = {**base, "AUTOPLAN_PROFILE_DIR": os.path.join(tmp, "none"),
                   "AUTOPLAN_AUTO_CALIBRATE": "0"}
        env = {**base, "AUTOPLAN_PROFILE_DIR": os.path.join(tmp, "profiles"),
               "AUTOPLAN_AUTO_CALIBRATE": "1"}

        def ratios(env: dict[str, str], tag: str) -> list[tuple[float, float]]:
            out = []
            for world, force, label in FAMILIES:
                path = os.path.join(tmp, f"{tag}-{world}-{len(out)}.json")
                _plan(args.model, world, force, path, env)
                out.append(_run(args.model, path, args.steps, env))
            return out

        raw = ratios(raw_env, "raw")        # the placeholders a CPU without a profile gets
        first = ratios(env, "first")        # first use: the automatic quick calibration
        plans = []                          # dp2 and tp2: few transfers and many
        for world, force, label in FAMILIES[:2]:
            plans.append(os.path.join(tmp, f"calibrate-{label}.json"))
            _plan(args.model, world, force, plans[-1], env)
        print(_autoplan("calibrate", *plans, "--model", args.model, env=env))
        calibrated = ratios(env, "cal")
        again = ratios(env, "again")        # the same plans once more: the run-to-run spread
        print(f"{'family':<32} {'placeholders':>12} {'first use':>10} "
              f"{'calibrated: two runs of the plan':>40}")
        print(f"{'':<32} {'meas./pred.':>12} {'meas./pred.':>11} "
              f"{'predicted  measured (meas./pred.)':>39}")
        worst = worst_first = spread = 0.0
        for (world, force, label), r, f, c, a in zip(FAMILIES, raw, first, calibrated, again):
            ratios_ = [c[0] / c[1], a[0] / a[1]]
            worst = max(worst, *(abs(x - 1) for x in ratios_))
            worst_first = max(worst_first, abs(f[0] / f[1] - 1))
            spread = max(spread, max(c[0], a[0]) / min(c[0], a[0]) - 1)
            print(f"{label:<32} {r[0] / r[1]:>12.2f} {f[0] / f[1]:>11.2f} {c[1]:>9.1f} ms "
                  f"{c[0]:>7.1f} ({ratios_[0]:.2f}) {a[0]:>7.1f} ({ratios_[1]:.2f})")
        print(f"worst error: first use {worst_first * 100:.0f} % (goal 25 %), calibrated "
              f"{worst * 100:.0f} % (goal 15 %); the same plan's two runs differ by up to "
              f"{spread * 100:.0f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
