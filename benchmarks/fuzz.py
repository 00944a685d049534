"""Fuzz every file format autoplan reads, and print what happened to each mutant.

    python benchmarks/fuzz.py                  # 10,000 mutants per format
    python benchmarks/fuzz.py --mutants 500 --format cluster-yaml
    python benchmarks/fuzz.py --arguments      # then every CLI and API argument case

Formats: a plan (``plan.json``), a cluster file as YAML and as JSON, a profile database, an
OpGraph (``autoplan trace -o``), a checkpoint description (``autoplan.json``). Each mutant is a seed file changed by one of: flipped bytes,
truncation, invalid UTF-8, a duplicated or dropped line, a number swapped for an extreme
(40-digit, 5,000-digit, 1e38, NaN, Infinity), a value replaced by another type, deep nesting,
a huge string, a YAML alias bomb or a Python tag. Each is read the way autoplan reads it, and
what is accepted is used (a cluster priced, a graph estimated) so that a file accepted but
broken counts too.

Outcomes: ``refused`` (autoplan's own typed error), ``accepted``, ``untyped`` (any other
exception: a bug), ``hang`` (over the time limit: a bug), ``executed`` (a side effect of code
in the file ran: a bug). The suite runs the same with 1,000 mutants per format
(``tests/test_fuzz.py``).
"""

from __future__ import annotations

import argparse
import atexit
import collections
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

FORMATS = ("plan", "plan-objectives", "cluster-yaml", "cluster-json", "profile", "opgraph", "checkpoint-meta",
           "seq-lengths")
EXTREMES = ["0", "-1", "1e38", "-1e308", "1" * 40, "9" * 5000, "NaN", "Infinity", "-Infinity",
            "0.5", "true", "null", '"x"', "[]", "{}"]
SENTINEL = os.path.join(tempfile.gettempdir(), "autoplan-fuzz-executed")


class Hang(Exception):
    pass


def _alarm(_signum, _frame):
    raise Hang()


# ---- seeds ---------------------------------------------------------------------------------------

def seeds() -> dict[str, bytes]:
    """One valid file per format, small so that each mutant reads fast."""
    import warnings

    import torch
    from torch import nn

    import autoplan
    from autoplan import Cluster
    from autoplan.cluster.profile_db import Calibration, OpTiming, ProfileDB
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    g = autoplan.trace(model, (torch.randn(4, 8),), loss_fn=nn.functional.cross_entropy,
                       targets=torch.randint(0, 4, (4,)))
    plan = autoplan.plan(g, Cluster.local(2), global_batch_size=4, precision="fp32",
                         profile=None, force={"tp": 2}, max_pp=1)
    # with its one replica's share written out (config.dp_shares), so mutants reach the field
    from dataclasses import replace
    shares = replace(plan.config, dp_shares=(plan.config.microbatches(4),))
    plan = replace(plan, config=shares, predicted={**json.loads(plan.to_json())["predicted"],
                                                   "config": shares.to_dict()})
    # a plan of the objectives search (plan schema 8: its objectives section)
    chosen = autoplan.plan(g, Cluster.local(2), global_batch_size=4, precision="fp32",
                           profile=None, max_pp=1, max_gpus=2, objective="energy",
                           economics={"usd_per_gpu_hour": 1.5, "tdp_watt": 100.0})
    import yaml
    cluster = {"preset": "dgx-h100/4", "num_nodes": 2,
               "host": {"memory_bytes": 2 * 10 ** 12}, "description": "fuzz seed"}
    cal = Calibration(matmul_flops_per_s=5e10, memory_bandwidth_bytes_per_s=1e10, launch_s=3e-6,
                      optimizer_s_per_param=5e-9, optimizer_s_per_tensor=2e-5,
                      step_overhead_s=4e-4,
                      matmul_size_efficiency=((32.0, 0.4), (256.0, 1.0)),
                      elementwise_s_per_element=(("gelu_tanh", 1.2e-9, 1.5e-9),))
    prof = ProfileDB(device="cpu-fuzz", device_kind="cpu", threads=2, torch_version="2.x",
                     calibration=cal, sources=("fuzz",),
                     entries={"aten.linear.default|x": OpTiming(fwd_s=1e-5, bwd_s=2e-5, fwd_cv=0.1,
                                                                bwd_cv=0.1, repeats=5)})
    return {"plan": plan.to_json().encode(), "plan-objectives": chosen.to_json().encode(),
            "cluster-yaml": yaml.safe_dump(cluster, sort_keys=False).encode(),
            "cluster-json": json.dumps(Cluster.preset("dgx-h100", nodes=2).to_dict(),
                                       indent=1).encode(),
            "profile": prof.to_json().encode(),
            "opgraph": g.to_json(indent=1).encode(),
            "checkpoint-meta": json.dumps(_checkpoint_meta(), indent=1).encode(),
            "seq-lengths": b"# tokens,documents\nlength,count\n300,120\n2000,40\n16384,3\n"}


def _checkpoint_meta() -> dict:
    """What ``trainer.save`` writes next to the DCP files (``autoplan.json``)."""
    return {"format": "autoplan-checkpoint", "version": 1, "step": 3, "samples_seen": 24,
            "world_size": 2, "aliases": {"head.weight": ["embed.weight", "head.weight"]},
            "plan": {"model": "fuzz", "model_fingerprint": "ab" * 8, "global_batch_size": 8,
                     "config": {"dp": 2, "tp": 1}},
            "model": {"embed.weight": {"shape": [16, 8], "dtype": "float32"},
                      "ln.bias": {"shape": [8], "dtype": "float32"}},
            "optimizer": {"classes": ["AdamW"],
                          "state": {"embed.weight": {
                              "exp_avg": {"kind": "elementwise", "dtype": "float32",
                                          "shape": [16, 8], "on_param_device": True},
                              "step": {"kind": "scalar", "dtype": "float32", "shape": [],
                                       "on_param_device": False}}},
                          "hparams": {"embed.weight": {"lr": 0.001, "betas": [0.9, 0.999],
                                                       "amsgrad": False}}},
            "lr_scheduler": {"last_epoch": 3, "base_lrs": [0.001]},
            "loss_scaler": {"scale": 65536.0, "good_steps": 3, "skipped_steps": 0}}


# ---- mutations -------------------------------------------------------------------------------------

def _structural(data: bytes, rng: random.Random, yaml_like: bool) -> bytes:
    """Parse, replace one random node with a value of another kind, write back."""
    import yaml
    try:
        obj = yaml.safe_load(data) if yaml_like else json.loads(data)
    except Exception:
        return data
    nodes = []
    stack: list[tuple[Any, Any]] = [(None, None)]
    root = {"_": obj}
    stack = [(root, "_")]
    while stack:
        parent, key = stack.pop()
        nodes.append((parent, key))
        v = parent[key]
        if isinstance(v, dict):
            stack.extend((v, k) for k in v)
        elif isinstance(v, list):
            stack.extend((v, i) for i in range(len(v)))
    parent, key = rng.choice(nodes)
    depth = rng.choice([10, 100, 5000])
    deep: Any = 0
    for _ in range(depth):
        deep = [deep]
    parent[key] = rng.choice([None, True, -1, 0, 2 ** 70, 1e300, float("nan"), "", "x" * 10,
                              "x" * (rng.choice([10, 10 ** 6])), [], {}, [1, "a", None],
                              {"unknown": 1}, deep])
    try:
        if yaml_like:
            return yaml.safe_dump(root["_"]).encode()
        return json.dumps(root["_"]).encode()
    except Exception:
        return data


def _duplicate_key(data: bytes, rng: random.Random, yaml_like: bool) -> bytes:
    lines = data.split(b"\n")
    i = rng.randrange(len(lines))
    lines.insert(i, lines[i])
    return b"\n".join(lines)


def mutate(data: bytes, rng: random.Random, fmt: str) -> bytes:
    yaml_like = fmt == "cluster-yaml"
    kind = rng.randrange(10)
    b = bytearray(data)
    if kind == 0:                                   # flip bytes
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    if kind == 1:                                   # truncate
        return bytes(b[:rng.randrange(len(b))])
    if kind == 2:                                   # invalid UTF-8 / junk
        i = rng.randrange(len(b))
        return bytes(b[:i]) + rng.choice([b"\xff\xfe", b"\x00", b"\xc3", b"{{{", b"]]"]) \
            + bytes(b[i:])
    if kind == 3:
        return _duplicate_key(data, rng, yaml_like)
    if kind == 4:                                   # drop a line
        lines = data.split(b"\n")
        del lines[rng.randrange(len(lines))]
        return b"\n".join(lines)
    if kind in (5, 6):                              # swap a number for an extreme
        text = data.decode("utf-8", "replace")
        spots = [i for i in range(len(text) - 1) if text[i].isdigit()
                 and (i == 0 or not text[i - 1].isalnum())]
        if not spots:
            return data
        i = rng.choice(spots)
        j = i
        while j < len(text) and (text[j].isdigit() or text[j] in ".e-+"):
            j += 1
        return (text[:i] + rng.choice(EXTREMES) + text[j:]).encode()
    if kind == 7:
        return _structural(data, rng, yaml_like)
    if kind == 8 and yaml_like:                     # alias bomb / python tag / huge string
        choice = rng.randrange(3)
        if choice == 0:
            bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
            for k in range(1, 12):
                prev = chr(ord("a") + k - 1)
                cur = chr(ord("a") + k)
                bomb += f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]\n"
            return data + b"\n" + bomb.encode()
        if choice == 1:
            return data + (f"\nevil: !!python/object/apply:os.system ['touch {SENTINEL}']\n"
                           ).encode()
        return data + b"\ndescription: " + b"x" * (30 << 20) + b"\n"
    if kind == 8:                                   # deep nesting / huge string in JSON
        return rng.choice([b"[" * 100000 + b"]" * 100000,
                           b'{"x": "' + b"y" * (30 << 20) + b'"}'])
    return bytes(b) + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))


# ---- readers --------------------------------------------------------------------------------------

def readers() -> dict[str, Callable[[bytes], Any]]:
    import autoplan
    from autoplan import Cluster, ParallelConfig, estimate
    from autoplan.cluster.profile_db import ProfileDB
    from autoplan.planner.planfile import Plan
    tmp = tempfile.mkdtemp(prefix="autoplan-fuzz-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    local = Cluster.local(2)

    def cluster(data: bytes, suffix: str) -> Any:
        path = os.path.join(tmp, "cluster" + suffix)
        with open(path, "wb") as f:
            f.write(data)
        c = Cluster.from_file(path)
        return c.collective_time_s("all_reduce", 1e9, list(range(min(c.world_size, 64))))

    def graph(data: bytes) -> Any:
        g = autoplan.OpGraph.from_json(data)
        return estimate(g, local, config=ParallelConfig(dp=1, tp=2, micro_batch_size=1,
                                                        precision="fp32"),
                        global_batch_size=1, profile=None).step_time_s

    def checkpoint_meta(data: bytes) -> Any:
        from pathlib import Path

        from autoplan.runtime.checkpoint_files import META_FILE, model_mismatch, read_meta
        step = Path(tmp) / "step-00000003"
        step.mkdir(exist_ok=True)
        (step / META_FILE).write_bytes(data)
        meta = read_meta(step)
        return model_mismatch(meta["model"], {})        # what a resume compares

    def seq_lengths(data: bytes) -> Any:
        from autoplan.sharding.doc_work import PackedWork
        from autoplan.sharding.seq_lengths import parse_seq_lengths
        work = PackedWork(parse_seq_lengths(data), 256, samples=4)   # packed and priced
        return work.dense_share(), work.ring_share(4, "zigzag")

    return {"plan": lambda d: Plan.from_json(d), "plan-objectives": lambda d: Plan.from_json(d),
            "checkpoint-meta": checkpoint_meta,
            "cluster-yaml": lambda d: cluster(d, ".yaml"),
            "cluster-json": lambda d: cluster(d, ".json"),
            "profile": lambda d: ProfileDB.from_text(d),
            "opgraph": graph, "seq-lengths": seq_lengths}


def run(formats=FORMATS, mutants: int = 1000, seed: int = 0, time_limit_s: float = 5.0,
        report: Callable[[str], None] | None = None) -> dict[str, collections.Counter]:
    """Counts of outcomes per format; ``report`` gets a line per bug found."""
    import warnings

    from autoplan.errors import AutoplanError
    warnings.simplefilter("ignore")
    os.environ.setdefault("AUTOPLAN_AUTO_CALIBRATE", "0")   # the same local cluster anywhere
    base, read = seeds(), readers()
    old = signal.signal(signal.SIGALRM, _alarm)
    counts: dict[str, collections.Counter] = {}
    try:
        for fmt in formats:
            rng = random.Random(f"{seed}-{fmt}")
            c = counts[fmt] = collections.Counter()
            for k in range(mutants):
                data = mutate(base[fmt], rng, fmt)
                if os.path.exists(SENTINEL):
                    os.remove(SENTINEL)
                signal.setitimer(signal.ITIMER_REAL, time_limit_s)
                try:
                    read[fmt](data)
                    outcome = "accepted"
                except Hang:
                    outcome = "hang"
                except AutoplanError:
                    outcome = "refused"
                except Exception:
                    outcome = "untyped"
                    if report:
                        report(f"{fmt} mutant {k}: {traceback.format_exc(limit=-3)}")
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                if os.path.exists(SENTINEL):
                    outcome = "executed"
                if outcome == "hang" and report:
                    report(f"{fmt} mutant {k}: over {time_limit_s} s ({len(data):,} bytes)")
                c[outcome] += 1
    finally:
        signal.signal(signal.SIGALRM, old)
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=int, default=10_000)
    ap.add_argument("--format", choices=FORMATS, action="append")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arguments", action="store_true",
                    help="then fuzz the CLI and API arguments too (fuzz_arguments.py)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    bugs: list[str] = []
    counts = run(args.format or FORMATS, args.mutants, args.seed, report=bugs.append)
    print(f"{'format':14s} {'mutants':>8s} {'refused':>8s} {'accepted':>9s} {'untyped':>8s} "
          f"{'hang':>5s} {'executed':>9s}")
    for fmt, c in counts.items():
        print(f"{fmt:14s} {sum(c.values()):8d} {c['refused']:8d} {c['accepted']:9d} "
              f"{c['untyped']:8d} {c['hang']:5d} {c['executed']:9d}")
    print(f"{time.perf_counter() - t0:.1f} s")
    for b in bugs[:20]:
        print(b)
    if args.arguments:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import fuzz_arguments
        sys.argv = sys.argv[:1]
        return max(1 if bugs else 0, fuzz_arguments.main())
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
