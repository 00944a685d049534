"""Per option of issue 39, the device memory it saves and the step time it costs, on the issue's
three setups (bf16, AdamW, roofline prices: ``profile=None``):

- GPT-3 175B on 128 A100 80 GB (``dgx-a100-80gb:16``), global batch 1536, sequence 2048;
- Llama-3-70B on 8 H100 (``dgx-h100``), global batch 64, sequence 8192 (the example's);
- Llama-3-8B on one H100 (``dgx-h100/1``: one GPU of a DGX H100, the node's 2 TB of host
  memory), sequence 8192, the largest micro-batch that fits (found first, then held).

For each setup, the **baseline** is the default search's plan (no lossy option, autocast). Each
option is then measured two ways:

- **on the plain layout** (``alone``): the baseline's mesh, micro-batch, schedule, ZeRO
  stage and per-op sharding with every memory option off (no recomputation, offload, low-precision state, master
  weights or fp8: the ``plain`` row), then the option alone switched on, estimated
  (``autoplan.estimate``): the memory it saves and the time it costs by itself;
- **planned** (``forced``): the default search with the option forced on (lossy options
  allowed for it): the fastest plan that uses it, its step time and peak memory against the
  baseline's (a memory option lets the search spend the memory on speed elsewhere).

``runs`` says where the planned configuration runs: on CPU ranks here and on CUDA, on CUDA only
(fp8: compute capability 8.9+), or refused by ``compile`` (NVMe), as the runtime's own refusal
check (``runtime/trainer.py``) says for a CPU rank.

    python benchmarks/memory_options.py [gpt3-175b|llama3-70b|llama3-8b ...]

Output committed as ``benchmarks/data/memory_options.txt``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import torch

import autoplan
from autoplan import Cluster, ParallelConfig
from autoplan.errors import AutoplanError
from autoplan.models.registry import build_example
from autoplan.planner import search_space
from autoplan.planner.compare import plan_sharding
from autoplan.planner.search import plan

_GIB = 2.0 ** 30


@dataclasses.dataclass(frozen=True)
class Setup:
    name: str
    example: str
    cluster: str
    global_batch: int
    one_gpu: bool = False        # find the largest micro-batch that fits, then hold it


SETUPS = {
    "gpt3-175b": Setup("GPT-3 175B / 128 A100", "gpt3-175b", "dgx-a100-80gb:16", 1536),
    "llama3-70b": Setup("Llama-3-70B / 8 H100", "llama3-70b", "dgx-h100", 64),
    "llama3-8b": Setup("Llama-3-8B / 1 H100", "llama3-8b", "dgx-h100/1", 64, one_gpu=True),
}

# every memory option off: the plain layout the options are switched on over, one at a time
PLAIN = dict(recompute="none", layer_recompute=None, stage_recompute=None,
             offload_optimizer=False, offload_params=False, offload_nvme=False,
             offload_activations=0, layer_offload=None, optimizer_state="fp32",
             mixed_precision="autocast",
             fp8="none", fp8_skip=(), grad_compression="none", powersgd_rank=1)


def options(layers_per_stage: int) -> list[tuple[str, dict[str, Any], bool]]:
    """(label, the fields that switch it on, lossy)."""
    return [
        ("recompute full, every layer", dict(recompute="full"), False),
        ("recompute selective (attention)", dict(recompute="selective"), False),
        ("recompute ops (keep products)", dict(recompute="ops"), False),
        ("recompute per layer (DP)", {}, False),            # the baseline's own choice
        ("activation offload, every layer", dict(offload_activations=layers_per_stage), False),
        ("optimizer offload", dict(offload_optimizer=True), False),
        ("parameter offload (ZeRO-3)", dict(zero_stage=3, offload_params=True), False),
        ("Adam states bf16", dict(optimizer_state="bf16"), True),
        ("Adam states 8-bit", dict(optimizer_state="8bit"), True),
        ("master weights (params)", dict(mixed_precision="params"), False),
        ("fp8 tensorwise", dict(fp8="tensorwise", compiled=True), False),
        ("fp8 rowwise", dict(fp8="rowwise", compiled=True), False),
        ("NVMe (ZeRO-Infinity)", dict(offload_optimizer=True, offload_nvme=True), False),
        ("PowerSGD rank 4", dict(grad_compression="powersgd", powersgd_rank=4), True),
    ]


def _graph(example: str):
    ex = build_example(example, device="meta")
    return autoplan.trace(ex.model, ex.example_inputs, loss_fn=ex.loss_fn, targets=ex.targets)


def _estimate(graph, cluster, cfg: ParallelConfig, gbs: int, sharding=None):
    return autoplan.estimate(graph, cluster, config=cfg, global_batch_size=gbs, profile=None,
                             sharding=sharding)


def _plan(graph, cluster, gbs: int, force: dict[str, Any], lossy: bool = False):
    return plan(graph, cluster, global_batch_size=gbs, precision="bf16", profile=None,
                top_k=0, force=force, allow_lossy=lossy)


def _runs(p: Any, cluster: Cluster) -> str:
    """Where plan ``p`` runs, as the runtime's refusal check says for a CPU rank and, for fp8,
    for the cluster's GPU."""
    from autoplan.runtime.float8 import MIN_CUDA_CAPABILITY
    from autoplan.runtime.trainer import _refuse_unrunnable   # the runtime's own check
    cfg = p.config
    try:
        _refuse_unrunnable(p, has_loss=True, device=torch.device("cpu"))
    except AutoplanError as e:
        if cfg.fp8 != "none" and cfg.tp == 1:
            fp8 = "fp8" in cluster.device.peak_flops
            return (f"CUDA cc>={MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]} only"
                    + ("" if fp8 else f"; not on {cluster.device.name}"))
        return "refused: " + str(e).split(",")[0].split("(")[0][:48]
    return "CPU+CUDA"


def _largest_micro_batch(graph, cluster, gbs: int) -> tuple[int, Any]:
    best = None
    for mbs in (1, 2, 4, 8, 16, 32, 64):
        if mbs > gbs:
            break
        try:
            p = _plan(graph, cluster, gbs, {"micro_batch_size": mbs})
        except AutoplanError:
            break
        best = (mbs, p)
    if best is None:
        raise SystemExit(f"nothing fits {cluster.name} even at micro-batch 1")
    return best


def _row(label, short, step_s, peak, base_step, base_peak, fits, runs=""):
    saved = (base_peak - peak) / _GIB
    cost = (step_s / base_step - 1) * 100
    return (f"  {label:33s} {short:84s} {step_s:9.3f} {peak / _GIB:7.1f} {saved:+8.1f} "
            f"{cost:+8.1f}% {'yes' if fits else 'NO':4s} {runs}")


def run_setup(key: str) -> None:
    s = SETUPS[key]
    t0 = time.perf_counter()
    graph = _graph(s.example)
    cluster = Cluster.from_spec(s.cluster)
    hold: dict[str, Any] = {}
    if s.one_gpu:
        mbs, base = _largest_micro_batch(graph, cluster, s.global_batch)
        hold = {"micro_batch_size": mbs}
        print(f"largest micro-batch that fits: {mbs} (global batch {s.global_batch})")
    else:
        base = _plan(graph, cluster, s.global_batch, {})
    bp = base.predicted
    b_step, b_peak = float(bp["step_time_s"]), float(bp["peak_memory_bytes"])
    layers = sum(len(b.instances) for b in graph.blocks)
    per_stage = max(1, layers // (base.config.pp * base.config.virtual_stages))
    plain_cfg = ParallelConfig(**{**base.config.to_dict(), **PLAIN,
                                  "zero_stage": base.config.zero_stage})
    sharding = plan_sharding(base, graph)        # the baseline's per-op strategies
    again = _estimate(graph, cluster, base.config, s.global_batch, sharding)
    plain = _estimate(graph, cluster, plain_cfg, s.global_batch, sharding)
    p_step, p_peak = plain.step_time_s, plain.peak_memory_bytes
    print(f"== {s.name}: autoplan.plan(trace({s.example!r} on meta), Cluster.from_spec("
          f"{s.cluster!r}), global_batch_size={s.global_batch}, precision='bf16', "
          f"profile=None{', force=' + str(hold) if hold else ''})")
    print(f"   device {cluster.device.name}, {cluster.device.memory_bytes / _GIB:.0f} GiB; host "
          f"{cluster.host.memory_bytes / cluster.devices_per_node / _GIB:,.0f} GiB per device; "
          f"NVMe {'yes' if cluster.host.has_nvme else 'none'}")
    if cluster.world_size > 1:
        probe = 2.0 ** 30
        rate = probe / cluster.collective_time_s("all_reduce", probe, list(range(cluster.world_size)))
        print(f"   all-reduce over every rank: {rate / 1e9:.1f} GB/s algorithm bandwidth; PowerSGD "
              f"is offered where dp's is under {search_space.POWERSGD_MAX_BYTES_PER_S / 1e9:g} "
              f"GB/s ({'so it may be' if rate < search_space.POWERSGD_MAX_BYTES_PER_S else 'not here'})")
    head = (f"  {'option':33s} {'configuration':84s} {'step s':>9s} {'peak':>7s} {'saved':>8s} "
            f"{'cost':>9s} {'fits':4s} runs")
    print(" baseline (default search) and the plain layout (every memory option off):")
    print(head.replace("saved", "GiB").replace("cost", "") + "")
    print(_row("baseline", base.config.short(), b_step, b_peak, b_step, b_peak, bp["fits"],
               _runs(base, cluster)))
    print(_row("baseline, estimated again", base.config.short(), again.step_time_s,
               again.peak_memory_bytes, b_step, b_peak, again.fits))
    print(_row("plain", plain_cfg.short(), p_step, p_peak, b_step, b_peak, plain.fits))
    alone, planned = [], []
    for label, fields, lossy in options(per_stage):
        alone.append(_alone(label, fields, base, plain_cfg, graph, cluster, s, p_step, p_peak,
                            sharding))
        planned.append(_forced(label, fields, lossy, hold, graph, cluster, s, b_step, b_peak))
    print(" each option alone on the plain layout (estimate): saved = plain - it, cost vs plain")
    print(head)
    print("\n".join(alone))
    print(" the default search with the option forced (plan): saved = baseline - it, cost vs "
          "baseline")
    print(head)
    print("\n".join(planned))
    print(f" ({time.perf_counter() - t0:.0f} s)\n", flush=True)


def _alone(label, fields, base, plain_cfg, graph, cluster, s, p_step, p_peak, sharding) -> str:
    if not fields:          # per layer: the baseline's own per-layer choice on the plain layout
        if base.config.layer_recompute is None:
            return f"  {label:33s} (the baseline recomputes no layer-by-layer mix: "\
                   f"{base.config.recompute})"
        fields = {"layer_recompute": base.config.layer_recompute,
                  "recompute": base.config.recompute}
    if fields.get("offload_nvme") and not cluster.host.has_nvme:
        return f"  {label:33s} not priced: the node has no NVMe ({cluster.name} describes none)"
    try:
        cfg = ParallelConfig(**{**plain_cfg.to_dict(), **fields})
        if cfg.fp8 != "none" and "fp8" not in cluster.device.peak_flops:
            return f"  {label:33s} not priced: {cluster.device.name} has no fp8 tensor cores"
        if cfg.grad_compression != "none" and not search_space.network_binds(cfg, cluster):
            note = " (the search does not offer it: the network does not bind)"
        else:
            note = ""
        e = _estimate(graph, cluster, cfg, s.global_batch, sharding)
    except AutoplanError as err:
        return f"  {label:33s} invalid here: {str(err)[:110]}"
    return _row(label, cfg.short(), e.step_time_s, e.peak_memory_bytes, p_step, p_peak,
                e.fits) + note


def _forced(label, fields, lossy, hold, graph, cluster, s, b_step, b_peak) -> str:
    if not fields:
        return f"  {label:33s} = the baseline (the default search chooses recomputation per layer)"
    if "fp8" in fields and "fp8" not in cluster.device.peak_flops:
        return (f"  {label:33s} not offered: {cluster.device.name} has no fp8 tensor cores "
                "(plan --precision auto says so and keeps bf16)")
    if fields.get("offload_nvme") and not cluster.host.has_nvme:
        return f"  {label:33s} not offered: the node has no NVMe ({cluster.name} describes none)"
    if "grad_compression" in fields and cluster.world_size == 1:
        return f"  {label:33s} not offered: one GPU, no data-parallel all-reduce to compress"
    try:
        p = _plan(graph, cluster, s.global_batch, {**fields, **hold}, lossy)
    except AutoplanError as err:
        return f"  {label:33s} no plan: {' '.join(str(err).split())[:120]}"
    pr = p.predicted
    note = ""
    if p.config.grad_compression != "none" and not search_space.network_binds(p.config, cluster):
        note = " (not offered unforced: the network does not bind)"
    return _row(label, p.config.short(), float(pr["step_time_s"]), float(pr["peak_memory_bytes"]),
                b_step, b_peak, pr["fits"], _runs(p, cluster)) + note


if __name__ == "__main__":
    import warnings
    warnings.simplefilter("ignore")
    for name in sys.argv[1:] or list(SETUPS):
        run_setup(name)
