"""What one GPU says about autoplan, in one run: the parts of ``benchmarks/gpu_check.sh``.

    python benchmarks/gpu_check.py zoo     --out zoo.json      # on a CUDA GPU
    python benchmarks/gpu_check.py speed   --out speed.json
    python benchmarks/gpu_check.py emulate --out emulate.json
    python benchmarks/gpu_check.py table   zoo.json speed.json emulate.json full-step.json
    python benchmarks/gpu_check.py zoo --small --out zoo.json  # the same code, tiny, on a CPU

- ``zoo``: every zoo model trained for 3 AdamW steps by a one-GPU bf16 plan and eagerly under
  ``torch.autocast``, each measured against fp32 training (the criterion of
  ``tests/test_zoo_16bit.py``: the plan's update error at most 1.5x eager's plus 1e-3);
- ``speed``: HF Llama (0.89B: hidden 2048, 16 layers, 16/8 heads, 8 x 2048 tokens) and the own
  GPT-3 1.3B in bf16, fused AdamW: autoplan's program eager and compiled, plain eager PyTorch,
  and ``torch.compile`` by hand, the same micro-batches each; ms per step (median) and peak
  memory, and autoplan's predicted step time and memory beside its own runs, with the
  compiled regions (layers and the parts between them), their kinds, dynamo's graphs and graph
  breaks (a part left eager shows as fewer graphs than kinds);
- ``emulate``: one rank of two 64-GPU plans of Llama-3-8B (dp8 x tp8 under ZeRO-3 over the 64,
  and dp2 x tp8 x pp4) alone on this GPU (``autoplan emulate``);
- ``table``: the results as one markdown table (and one JSON, ``--out``).

``--small`` shrinks every model to a few layers of width 64 so the pieces run on a CPU in a
test (``tests/test_gpu_check.py``); nothing it measures there is a GPU figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ZOO = ("hf-gpt2-lm-tiny", "hf-llama-gqa-tiny", "hf-mistral-tiny", "hf-qwen2-tiny",
       "hf-mixtral-tiny", "hf-bert-mlm-tiny", "hf-t5-tiny", "hf-vit-tiny", "torch-encoder-tiny",
       "nanogpt-tiny", "rootparam-tiny", "cnn-tiny", "titan-llama-tiny", "titan-moe-tiny",
       "region-llama-tiny", "region-cuda-llama-tiny")
LLAMA_1B = dict(hidden=2048, layers=16, heads=16, kv_heads=8, ffn=5632, vocab=32000,
                seq_len=2048, max_positions=2048)
SMALL = dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=256, seq_len=32,
             max_positions=64)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_peak() -> None:
    import gc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_bytes() -> float | None:
    return float(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


def _adamw(params: Any, lr: float = 1e-3, eps: float = 1e-4) -> torch.optim.Optimizer:
    """AdamW, fused where torch has the kernel (CUDA)."""
    return torch.optim.AdamW(params, lr=lr, eps=eps, fused=torch.cuda.is_available())


def _one_device_plan(graph: Any, gbs: int, precision: str, **force: Any) -> Any:
    from autoplan import Cluster, plan
    return plan(graph, Cluster.local(1), global_batch_size=gbs, precision=precision,
                force=force, max_pp=1)


# ---- zoo ---------------------------------------------------------------------------------------

def _zoo_model(name: str) -> dict[str, Any]:
    """One zoo model: the plan's run, eager autocast's and fp32's, and the two errors."""
    from autoplan.graph import trace
    from autoplan.models import build_example
    from autoplan.runtime.trainer import compile
    dev, gbs, steps = _device(), 8, 3
    amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16))

    def eager(autocast: bool) -> tuple[list[float], dict, dict]:
        ex = build_example(name, batch_size=gbs, seed=0)
        ex.model.to(dev)
        w0 = {k: v.detach().clone() for k, v in ex.model.state_dict().items()}
        opt = _adamw(ex.model.parameters())
        losses = []
        for _ in range(steps):
            with (amp() if autocast else contextlib.nullcontext()):
                loss = ex.loss_fn(ex.model(*[x.to(dev) for x in ex.example_inputs]),
                                  ex.targets.to(dev))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses, w0, {k: v.detach().clone() for k, v in ex.model.state_dict().items()}
    fp32_losses, w0, fp32 = eager(False)
    eager_losses, _, eager_w = eager(True)
    small = build_example(name, batch_size=1, seed=0)
    g = trace(small.model, small.example_inputs, loss_fn=small.loss_fn, targets=small.targets)
    p = _one_device_plan(g, gbs, "bf16", micro_batch_size=gbs)
    ex = build_example(name, batch_size=gbs, seed=0)
    tr = compile(ex.model, "local", example_inputs=small.example_inputs,
                 example_targets=small.targets, loss_fn=ex.loss_fn, optimizer=_adamw,
                 global_batch_size=gbs, plan=p)
    batch = tuple(ex.example_inputs) + (ex.targets,)
    plan_losses = [tr.step(batch) for _ in range(steps)]
    got = tr.full_state_dict()

    def dist_(a: dict, b: dict) -> float:
        return math.sqrt(sum(float((a[k].to(b[k].device, b[k].dtype) - b[k]).norm()) ** 2
                             for k in b if b[k].is_floating_point()))
    update = dist_(fp32, w0)
    e_eager, e_plan = dist_(eager_w, fp32) / update, dist_(got, fp32) / update
    ok = e_plan <= 1.5 * e_eager + 1e-3
    return dict(model=name, plan=p.config.short(), update_error_plan=e_plan,
                update_error_eager=e_eager, apart=dist_(got, eager_w) / update,
                loss_plan=plan_losses, loss_eager=eager_losses, loss_fp32=fp32_losses,
                verdict="OK" if ok else "FAIL")


def zoo(small: bool) -> list[dict[str, Any]]:
    out = []
    for name in ZOO[:3] if small else ZOO:
        try:
            out.append(_zoo_model(name))
        except Exception as e:          # one model's failure is a result, not the end
            out.append(dict(model=name, verdict="CRASH", error=f"{type(e).__name__}: "
                            + (str(e).splitlines() or [""])[0][:300],
                            trace=traceback.format_exc()[-2000:]))
        print(_zoo_line(out[-1]), flush=True)
    return out


def _zoo_line(r: dict[str, Any]) -> str:
    if r["verdict"] == "CRASH":
        return f"{r['model']:24s} CRASH {r['error']}"
    return (f"{r['model']:24s} {r['verdict']:4s} update error plan {r['update_error_plan']:.2e}"
            f" eager {r['update_error_eager']:.2e}   {r['plan']}")


# ---- speed -------------------------------------------------------------------------------------

def _speed_models(small: bool) -> dict[str, tuple[str, dict[str, Any], int, int]]:
    """name -> (example, overrides, global batch, micro-batch)."""
    if small:
        return {"hf-llama": ("hf-llama-gqa-tiny", dict(SMALL), 4, 2),
                "gpt": ("gpt-tiny", {}, 4, 2)}
    return {"hf-llama-0.89b": ("hf-llama-gqa-tiny", dict(LLAMA_1B), 8, 8),
            "gpt3-1.3b": ("gpt3-1.3b", {}, 8, 4)}


def _timed(step: Callable[[], Any], steps: int) -> tuple[float, float | None]:
    """(median seconds per step over ``steps`` after two warm-up steps, peak bytes)."""
    _reset_peak()
    for _ in range(2):
        step()
    _sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), _peak_bytes()


def _by_hand(example: Any, mbs: int, compiled: bool) -> Callable[[], None]:
    """A training step as a user writes it: autocast bf16, micro-batches accumulated, fused
    AdamW; ``torch.compile`` on the whole model when ``compiled``."""
    dev = _device()
    model = example.model.to(dev)
    if compiled:
        model = torch.compile(model)
    opt = _adamw(model.parameters(), lr=1e-5)
    xs = [x.to(dev) for x in example.example_inputs]
    y = example.targets.to(dev)
    n = y.shape[0] // mbs

    def step() -> None:
        for k in range(n):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = example.loss_fn(model(*[x[k * mbs:(k + 1) * mbs] for x in xs]),
                                       y[k * mbs:(k + 1) * mbs])
            (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def speed(small: bool, steps: int, save: Callable[[list[dict[str, Any]]], None] = lambda rows: None
          ) -> list[dict[str, Any]]:
    """Each model's four variants; ``save`` gets the rows so far after each variant, so a run
    cut off by its time limit keeps what it measured."""
    from autoplan.graph import trace
    from autoplan.models import build_example
    from autoplan.runtime.trainer import compile
    out = []
    for label, (name, over, gbs, mbs) in _speed_models(small).items():
        row: dict[str, Any] = dict(model=label, tokens=f"{gbs} x {over.get('seq_len', '')}",
                                   device=_dev_name())
        for variant in ("eager", "torch.compile", "autoplan eager", "autoplan compiled"):
            try:
                ex = build_example(name, batch_size=gbs, seed=0, **over)
                if variant.startswith("autoplan"):
                    meta = build_example(name, batch_size=1, device="meta", **over)
                    g = trace(meta.model, meta.example_inputs, loss_fn=meta.loss_fn,
                              targets=meta.targets)
                    p = _one_device_plan(g, gbs, "bf16", micro_batch_size=mbs,
                                         compiled=variant.endswith("compiled"))
                    small_ex = build_example(name, batch_size=1, seed=0, **over)
                    tr = compile(ex.model, "local", example_inputs=small_ex.example_inputs,
                                 example_targets=small_ex.targets, loss_fn=ex.loss_fn,
                                 optimizer=lambda ps: _adamw(ps, lr=1e-5),
                                 global_batch_size=gbs, plan=p)
                    batch = tuple(ex.example_inputs) + (ex.targets,)
                    graphs = _dynamo_graphs()
                    s, peak = _timed(lambda: tr.step(batch), steps)
                    row[variant] = dict(step_s=s, peak_bytes=peak,
                                        predicted_step_s=p.predicted["step_time_s"],
                                        predicted_peak_bytes=p.predicted["peak_memory_bytes"],
                                        plan=p.config.short(), **graphs(tr.model))
                else:
                    s, peak = _timed(_by_hand(ex, mbs, variant == "torch.compile"), steps)
                    row[variant] = dict(step_s=s, peak_bytes=peak)
            except Exception as e:
                row[variant] = dict(error=f"{type(e).__name__}: "
                                    + (str(e).splitlines() or [""])[0][:300])
            print(label, variant, row[variant], flush=True)
            save(out + [row])
            torch.compiler.reset() if hasattr(torch, "compiler") else None
        out.append(row)
    return out


def _dynamo_graphs() -> Callable[[Any], dict[str, Any]]:
    """Counts dynamo's graphs from now; the returned function reads them with the compiled
    regions of a trainer's model (its layers and the parts between them: a part that stayed
    eager shows as fewer graphs than region kinds) and the graph breaks' count."""
    from torch._dynamo.utils import counters
    counters.clear()

    def read(model: Any) -> dict[str, Any]:
        regions = [type(m) for m in model.modules()
                   if getattr(m, "_compiled_call_impl", None) is not None]
        return dict(compiled_regions=len(regions), region_kinds=len(set(regions)),
                    graphs=counters["stats"]["unique_graphs"],
                    graph_breaks=sum(counters["graph_break"].values()))
    return read


def _dev_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


# ---- emulate -----------------------------------------------------------------------------------

EMULATED = {   # label -> (cluster, forced fields): Llama-3-8B on 64 GPUs, rank 0 of each
    "llama3-8b dp8 x tp8 zero3 (64 GPUs)": ("dgx-h100:8", dict(dp=8, tp=8, zero_stage=3)),
    "llama3-8b dp2 x tp8 x pp4 (64 GPUs)": ("dgx-h100:8", dict(dp=2, tp=8, pp=4)),
}
EMULATED_SMALL = {   # the same shapes on 16 CPU ranks
    "llama3-8b dp8 x tp8 zero3 (64 GPUs)": ("local:16", dict(dp=8, tp=2, zero_stage=3)),
    "llama3-8b dp2 x tp8 x pp4 (64 GPUs)": ("local:16", dict(dp=4, tp=2, pp=2)),
}


def emulate_plans(small: bool) -> list[dict[str, Any]]:
    import multiprocessing as mp
    out = []
    for label, (cluster, force) in (EMULATED_SMALL if small else EMULATED).items():
        # each in a process of its own: the fake process group is per process
        with mp.get_context("spawn").Pool(1) as pool:
            out.append(pool.apply(_emulate_one, (label, cluster, force, small)))
        print(label, out[-1], flush=True)
    return out


def _emulate_one(label: str, cluster: str, force: dict[str, Any], small: bool
                 ) -> dict[str, Any]:
    from autoplan.estimate.arguments import cluster_arg
    from autoplan.graph import trace
    from autoplan.models import build_example
    from autoplan.planner.search import plan
    from autoplan.runtime.emulate import emulate
    name, over, gbs = (("hf-llama-gqa-tiny", dict(SMALL), 16) if small
                       else ("hf-llama3-8b", {}, 64))
    try:
        meta = build_example(name, batch_size=1, device="meta", **over)
        g = trace(meta.model, meta.example_inputs, loss_fn=meta.loss_fn, targets=meta.targets)
        p = plan(g, cluster_arg(cluster, "gpu_check"), global_batch_size=gbs, precision="bf16",
                 force=force, max_pp=force.get("pp", 1))
        fresh = build_example(name, batch_size=1, device="meta", **over)
        e = emulate(p, fresh.model, example_inputs=fresh.example_inputs,
                    example_targets=fresh.targets, loss_fn=fresh.loss_fn, rank=0, steps=3)
        return dict(label=label, plan=p.config.short(), device=e.device,
                    step_s=e.median_step_s, predicted_compute_s=e.predicted.compute_s,
                    peak_bytes=e.peak_memory_bytes,
                    predicted_peak_bytes=e.predicted.peak_memory_bytes,
                    weight_bytes=e.weight_bytes,
                    predicted_weight_bytes=e.predicted.weight_bytes, report=e.report())
    except Exception as e:
        return dict(label=label, error=f"{type(e).__name__}: "
                    + (str(e).splitlines() or [""])[0][:300])


# ---- table -------------------------------------------------------------------------------------

def _ms(x: Any) -> str:
    return f"{x * 1e3:,.1f}" if isinstance(x, (int, float)) else "-"


def _gib(x: Any) -> str:
    return f"{x / 2**30:,.2f}" if isinstance(x, (int, float)) else "-"


def table(results: dict[str, Any]) -> str:
    lines = [f"# GPU check on {results.get('device', '?')} (torch {results.get('torch', '?')})",
             ""]
    if results.get("zoo"):
        lines += ["## Zoo in bf16 against eager autocast (update error vs fp32)", "",
                  "| model | verdict | plan | eager | plan config |", "|---|---|---|---|---|"]
        for r in results["zoo"]:
            if r["verdict"] == "CRASH":
                lines.append(f"| {r['model']} | CRASH | {r['error'][:80]} | | |")
            else:
                lines.append(f"| {r['model']} | {r['verdict']} | {r['update_error_plan']:.2e}"
                             f" | {r['update_error_eager']:.2e} | {r['plan']} |")
        lines.append("")
    if results.get("speed"):
        lines += ["## Speed and memory on one GPU (ms per step, GiB peak)", "",
                  "| model | eager | torch.compile | autoplan eager | autoplan compiled | "
                  "autoplan / torch.compile | autoplan / eager | predicted (eager, compiled) |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results["speed"]:
            cell = {k: r.get(k, {}) for k in ("eager", "torch.compile", "autoplan eager",
                                              "autoplan compiled")}
            best = min((c["step_s"] for k, c in cell.items()
                        if k.startswith("autoplan") and "step_s" in c), default=None)
            ratio = (lambda a, b: f"{a / b:.3f}" if a and b else "-")
            lines.append(
                f"| {r['model']} | " + " | ".join(
                    f"{_ms(c.get('step_s'))} / {_gib(c.get('peak_bytes'))}"
                    if "step_s" in c else f"error: {c.get('error', '-')[:40]}"
                    for c in cell.values())
                + f" | {ratio(best, cell['torch.compile'].get('step_s'))}"
                + f" | {ratio(best, cell['eager'].get('step_s'))}"
                + f" | {_ms(cell['autoplan eager'].get('predicted_step_s'))}, "
                  f"{_ms(cell['autoplan compiled'].get('predicted_step_s'))} ms / "
                  f"{_gib(cell['autoplan eager'].get('predicted_peak_bytes'))} GiB |")
        lines.append("")
    if results.get("emulate"):
        lines += ["## One rank of a 64-GPU plan, alone (collectives faked)", "",
                  "| plan | compute measured / predicted ms | peak measured / predicted GiB |",
                  "|---|---|---|"]
        for r in results["emulate"]:
            if "error" in r:
                lines.append(f"| {r['label']} | error: {r['error'][:80]} | |")
            else:
                lines.append(f"| {r['label']}: {r['plan']} | {_ms(r['step_s'])} / "
                             f"{_ms(r['predicted_compute_s'])} | {_gib(r['peak_bytes'])} / "
                             f"{_gib(r['predicted_peak_bytes'])} |")
        lines.append("")
    if results.get("full_step"):
        fs = results["full_step"]
        lines += ["## The 1.7B validation row's whole step (benchmarks/gpu_full_step.py)", "",
                  "```", json.dumps({k: v for k, v in fs.items()
                                     if not isinstance(v, (list, dict))}, indent=1)[:1500],
                  "```"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("zoo", "speed", "emulate", "table"))
    ap.add_argument("inputs", nargs="*", help="table: the parts' JSON files")
    ap.add_argument("--out", required=True, help="write the part's results (JSON) here")
    ap.add_argument("--small", action="store_true", help="tiny models (a CPU test)")
    ap.add_argument("--steps", type=int, default=10, help="speed: timed steps per variant")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.part == "table":
        merged: dict[str, Any] = dict(device=_dev_name(), torch=torch.__version__)
        for f in args.inputs:
            if Path(f).exists():
                data = json.loads(Path(f).read_text())
                if isinstance(data, dict) and "part" in data:
                    merged[data["part"]] = data["results"]
                    merged["device"] = data.get("device", merged["device"])
                else:                       # benchmarks/gpu_full_step.py's file
                    merged["full_step"] = data
        Path(args.out).write_text(json.dumps(merged, indent=1, default=str))
        text = table(merged)
        Path(args.out).with_suffix(".md").write_text(text + "\n")
        print(text)
        return 0
    def save(results: list[dict[str, Any]]) -> None:
        Path(args.out).write_text(json.dumps(dict(part=args.part, device=_dev_name(),
                                                  results=results), indent=1, default=str))
    run = {"zoo": lambda: zoo(args.small),
           "speed": lambda: speed(args.small, args.steps, save),
           "emulate": lambda: emulate_plans(args.small)}[args.part]
    save(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
