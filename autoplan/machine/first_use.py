"""This CPU's first-use calibration: the figures a CPU without a profile gets measured once.

    python -m autoplan.machine.first_use DEVICE OUT.json

measures this CPU with the one thread a rank process runs with (``calibration.calibrate``: a
GEMM, a copy, a tiny op, AdamW and a net of tiny layers for the eager framework's per-op time),
then the loopback link between two rank processes (``probe_loopback``: timed gloo all-reduces
in ``python -m autoplan.runtime.link_probe``, fitted with the cluster's all-reduce formula), and
writes them as the ProfileDB of ``DEVICE`` (no ops) to ``OUT.json``; about 6 s.

``Cluster.local()`` runs it as a program of its own when this CPU has no profile
(``cluster.local.auto_calibration``, which saves the result where ``ProfileDB.find`` looks):
the cluster layer describes machines and imports nothing of the code that measures them, and
the measurement runs in a fresh process with one thread, as the ranks it prices will.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile

import torch

from autoplan.cluster.cluster import Cluster
from autoplan.cluster.local import DEFAULT_CPU_CALIBRATION, RANK_THREADS, cpu_cluster_dict
from autoplan.cluster.profile_db import ProfileDB
from autoplan.cost.refit import refit_link
from autoplan.machine.calibration import calibrate
from autoplan.machine.profiler import build_db


def rank_calibration_db(device: str) -> ProfileDB:
    """A ProfileDB of this CPU's calibration (no ops), measured with the threads one rank
    process runs with (``RANK_THREADS``), as a saved file gives it back."""
    threads = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)   # what one rank process gets (runtime/worker.py)
    try:
        db = build_db({}, calibrate("cpu"), device="cpu", device_name=device,
                      sources=("auto-calibration",))
    finally:
        torch.set_num_threads(threads)
    return ProfileDB.from_text(db.to_json())


def unit_terms(kind: str, nbytes: float, world: int) -> tuple[float, float]:
    """(A, B) of the cost model's time ``A * latency + B / bandwidth`` for one ``kind``
    collective of ``nbytes`` over ``world`` CPU ranks on the loopback link (for fits)."""
    ranks = list(range(world))
    return (_unit_cluster(world, 1e30, 1.0).collective_time_s(kind, nbytes, ranks),
            _unit_cluster(world, 1.0, 0.0).collective_time_s(kind, nbytes, ranks))


@functools.lru_cache(maxsize=16)
def _unit_cluster(world: int, bandwidth: float, latency: float) -> Cluster:
    d = cpu_cluster_dict(world, DEFAULT_CPU_CALIBRATION, memory_bytes=world << 30)
    d["device"]["compute_share"] = 1.0
    d["links"] = {"loopback": {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency,
                               "efficiency": 1.0, "source": "unit figures for a fit"}}
    return Cluster.from_dict(d)


def probe_loopback() -> dict[str, float] | None:
    """The loopback link's figures from timed all-reduces between two rank processes
    (``python -m autoplan.runtime.link_probe``, a separate program: planning starts no process
    group), fitted with the cost model's all-reduce formula; None when the probe fails."""
    with tempfile.TemporaryDirectory(prefix="autoplan-probe-") as tmp:
        out = os.path.join(tmp, "link.json")
        try:
            done = subprocess.run([sys.executable, "-m", "autoplan.runtime.link_probe", out],
                                  capture_output=True, timeout=120, check=False)
            if done.returncode != 0 or not os.path.exists(out):
                return None
            with open(out, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None
    terms = {}
    samples = []
    for nbytes, seconds in data.get("samples", []):
        if nbytes not in terms:
            terms[nbytes] = unit_terms("all_reduce", float(nbytes), 2)
        samples.append((*terms[nbytes], float(seconds)))
    fit = refit_link(samples)
    if fit is None:
        return None
    return {"bandwidth_bytes_per_s": fit.bandwidth_bytes_per_s, "latency_s": fit.latency_s}


def measure_this_cpu(device: str) -> ProfileDB:
    """This CPU's calibration as ``device``'s profile, with the loopback link where the probe
    gives one."""
    db = rank_calibration_db(device)
    link = probe_loopback()
    if link is not None:
        db = dataclasses.replace(db, links={**db.links, "loopback": link})
    return db


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m autoplan.machine.first_use DEVICE OUT.json")
    device, out = args
    torch.set_num_threads(RANK_THREADS)
    text = measure_this_cpu(device).to_json()
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
