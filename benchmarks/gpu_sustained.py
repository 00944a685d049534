"""Does a GPU keep its burst rate when it computes without a pause, as a training step does?

    python benchmarks/gpu_sustained.py --seconds 60 --out sustained.json   # on a CUDA GPU

Short benchmarks (``gpu_layers.py``, the calibration) time a few repeats on a cool card at its
boost clock; a training run keeps it busy for hours, at its power limit. This runs one rank's
GPT-3 175B layer (the 177B row's, ``gpu_layers.RankLayer``: hidden 12,288, TP 8, micro-batch
1, sequence 4,096, bf16) forward and backward back to back for ``--seconds``, and records per
window of about 2 s the layer's time and the card's SM clock, power draw and temperature
(nvidia-smi, sampled beside it). The first window against the last says how much a busy card
slows down.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_layers  # noqa: E402


_FIELDS = ["clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active"]


def _smi() -> dict[str, float]:
    """The card's SM clock, power draw, temperature and (where the driver names it so) the
    reasons its clock is held down, a bit mask (0x4: software power cap)."""
    while True:
        run = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(_FIELDS)}",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10)
        if run.returncode == 0 or len(_FIELDS) == 3:
            break
        del _FIELDS[3:]             # an older driver's name for it, or none: go without
    values = [x.strip() for x in run.stdout.strip().split(",")]
    out = {"sm_mhz": float(values[0]), "power_w": float(values[1]), "temp_c": float(values[2])}
    if len(values) > 3:
        out["clock_reasons"] = values[3]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    module, (x,) = gpu_layers.parts(12288, 96, 8, 1, "cuda")["layer"]
    module = module.to(torch.bfloat16)
    x = x.to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn_like(module(x))
    samples: list[dict] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            try:
                samples.append({"t": time.perf_counter(), **_smi()})
            except Exception as e:  # noqa: BLE001 - a missing nvidia-smi leaves the timings
                samples.append({"t": time.perf_counter(), "error": str(e)})
            stop.wait(0.5)

    def step() -> None:
        for p in module.parameters():
            p.grad = None
        x.grad = None
        module(x).backward(grad)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    windows = []
    t_end = time.perf_counter() + args.seconds
    while time.perf_counter() < t_end:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        n = 0
        start.record()
        while time.perf_counter() - t0 < args.window:
            step()
            n += 1
            if n % 16 == 0:
                torch.cuda.current_stream().synchronize()   # keep the host within reach
        end.record()
        end.synchronize()
        t1 = time.perf_counter()
        seen = [s for s in samples if t0 <= s["t"] <= t1 and "sm_mhz" in s]
        w = {"t_s": round(t1 - (t_end - args.seconds), 2), "layers": n,
             "layer_ms": start.elapsed_time(end) / n}
        if seen:
            for key in ("sm_mhz", "power_w", "temp_c"):
                w[key] = sum(s[key] for s in seen) / len(seen)
            w["clock_reasons"] = sorted({s.get("clock_reasons", "") for s in seen})
        windows.append(w)
        print(json.dumps(w), flush=True)
    stop.set()
    poller.join()
    first, last = windows[0]["layer_ms"], windows[-1]["layer_ms"]
    Path(args.out).write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
         "command": "python " + " ".join(sys.argv), "case": "177B row: hidden 12288, TP 8, "
         "micro-batch 1, sequence 4096, bf16, one rank's layer forward + backward",
         "windows": windows, "last_over_first": last / first}, indent=1) + "\n")
    print(f"layer {first:.3f} ms in the first window, {last:.3f} ms in the last "
          f"({last / first:.3f}x) after {args.seconds:.0f} s busy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
