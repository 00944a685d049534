"""Time gloo all-reduces between two rank processes on this machine (first-use calibration).

    python -m autoplan.runtime.link_probe OUT.json

Two forked processes, each with one thread as a rank has, join a gloo group over a file store
and all-reduce fp32 tensors of a few sizes (4 KiB to 16 MiB) after a warm-up, each after the same
short compute (a few GEMMs), as a training step's collectives follow its layers: timed from
there, an all-reduce includes waiting for the later peer and waking gloo's threads, which the
steps pay. (Back to back after a barrier, as this probe first did, the latency came out at half
what `autoplan calibrate` then fitted to real steps on the same machine: 390 against 860 us.)
Rank 0 writes ``{"world": 2, "kind": "all_reduce", "samples": [[bytes, seconds], ...]}``;
``autoplan.machine.first_use`` fits the loopback link's latency and bandwidth to them with the cost
model's own all-reduce formula. A separate program, so that planning never starts a process
group (the runtime is the only layer that does).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

SIZES_BYTES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
REPEATS = 12
WARMUP = 3
COMPUTE_PRODUCTS = 20       # the compute before each all-reduce (a few milliseconds)


def _rank(rank: int, store_path: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)        # first thing in a forked child (and what a rank runs with)
    import torch.distributed as dist

    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    samples = []
    a, b = torch.randn(256, 512), torch.randn(512, 512)     # ~0.1 ms a product on one core
    try:
        for nbytes in SIZES_BYTES:
            x = torch.ones(nbytes // 4)
            for i in range(WARMUP + REPEATS):
                for _ in range(COMPUTE_PRODUCTS):
                    torch.mm(a, b)
                t0 = time.perf_counter()
                dist.all_reduce(x)
                if i >= WARMUP:
                    samples.append([nbytes, time.perf_counter() - t0])
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"world": 2, "kind": "all_reduce", "samples": samples}, f)


def probe(out: str, timeout_s: float = 60.0) -> int:
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="autoplan-link-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, store, out)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        return max((p.exitcode or 0) != 0 for p in procs)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m autoplan.runtime.link_probe OUT.json")
    sys.exit(probe(sys.argv[1]))
