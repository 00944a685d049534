"""The search space: context-parallel degrees, and per mesh micro-batch sizes, pipeline
schedules, recomputation, and the
ZeRO / offload / HSDP / expert-parallel variants the planner costs (``search.plan`` walks it).

Every field a user forces (``SearchOptions.force``) narrows its own choice to the forced value;
pairs the runtime refuses are left out unless forced, so that what the planner may choose, the
runtime can run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from autoplan.cost.float8 import fp8_flops_per_s
from autoplan.cost.memory import model_state_bytes
from autoplan.errors import ConfigError
from autoplan.graph.analysis import analyze
from autoplan.graph.experts import find_experts
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.oprules import is_attention, uses_batch_statistics
from autoplan.planner.options import SearchOptions
from autoplan.sharding.config_rules import compression_refusal
from autoplan.sharding.context_axis import context_axis
from autoplan.sharding.parallel_config import (MIXED_PRECISION, SPLIT_BACKWARD, ParallelConfig,
                                               strongest_recompute)


def batch_statistics(graph: OpGraph | None) -> bool:
    """The model normalizes with its batch's statistics (a batch norm traced in training mode):
    one device computes them over the whole per-replica batch, so a plan that accumulates
    gradients over smaller micro-batches would train another model."""
    if graph is None or graph.meta.get("train", True) is False:
        return False
    # asked for every mesh and micro-batch: the ops are read once per graph (frozen)
    found = graph.__dict__.get("_autoplan_batch_statistics")
    if found is None:
        found = graph.__dict__["_autoplan_batch_statistics"] = any(
            uses_batch_statistics(op) for op in graph.ops)
    return found


def mbs_options(per_replica: int, opts: SearchOptions,
                graph: OpGraph | None = None) -> list[int]:
    """Micro-batch sizes worth costing: powers of two dividing the per-replica batch (the
    user's list when given); the whole per-replica batch alone for a model with batch
    statistics (``batch_statistics``) unless the user forces or lists others."""
    if opts.micro_batch_sizes:
        return [m for m in opts.micro_batch_sizes if per_replica % m == 0]
    if batch_statistics(graph):
        return [per_replica]
    out, m = [], 1
    while m <= min(per_replica, 64):
        if per_replica % m == 0:
            out.append(m)
        m *= 2
    return out or [per_replica]


def compiled_choice(opts: SearchOptions, cluster: Any) -> bool:
    """Whether the rank program runs ``torch.compile``'d (``ParallelConfig.compiled``): as
    forced (``--force compiled=true|false``), else on GPUs and not on CPU ranks. On one H200 the
    compiled program ran 0.81x (HF Llama 0.89B) and 0.61x (GPT-3 1.3B) of its eager step
    (``benchmarks/data/h200-gpu-check-20261127``), and the cost model prices it so (element-wise
    chains fused, ``cost/compute.py``). A CPU rank compiles slowly and its prices are calibrated
    eagerly. Where compilation rules an option out, the search offers the option's eager twin
    beside the compiled config: selective recomputation of layers that hold collectives
    (``with_compilation``), activation offload (``activation_offloads``), and offload per layer
    (``recompute_choice.refine_recompute``); the faster wins."""
    if "compiled" in opts.force:
        return bool(opts.force["compiled"])
    return cluster.device.kind != "cpu"


def mixed_precision_choices(opts: SearchOptions, precision: str) -> list[str]:
    """How a plan may hold its weights (``ParallelConfig.mixed_precision``): as forced, else the
    options' (autocast alone by default). "params" (Megatron-LM's --bf16: 16-bit weights and
    activations, the fp32 master copy with the optimizer) saves the fp32 weights' memory and
    autocast's casts, but runs norms and softmax in 16 bits where the model does not upcast
    them itself: a change of numerics the user opts into (``mixed_precision=("autocast",
    "params")``, or ``precision="auto"``, which hands the numerics to the search). An fp32
    plan has one choice: "params" is fp32 there."""
    wanted = [opts.force["mixed_precision"]] if "mixed_precision" in opts.force \
        else list(opts.mixed_precision) + (["params"] if opts.precision_auto else [])
    bad = [m for m in wanted if m not in MIXED_PRECISION]
    if bad or not wanted:
        raise ConfigError(f"mixed_precision choices must be among {list(MIXED_PRECISION)}, got "
                          f"{wanted}")
    if precision == "fp32":
        return wanted[:1] if "mixed_precision" in opts.force else ["autocast"]
    return list(dict.fromkeys(wanted))


def runs_master_weights(shape: Any) -> bool:
    """Whether the runtime runs 16-bit weights with an fp32 master copy on a mesh of this
    shape (not yet with context or expert parallelism, nor with the zero-bubble schedules,
    which ``schedules`` leaves out: ``trainer``'s refusal)."""
    return shape.cp == 1 and getattr(shape, "ep", 1) == 1


def forced(opts: SearchOptions, name: str, values: Sequence[Any]) -> list[Any]:
    if name in opts.force:
        return [opts.force[name]]
    return list(values)


def schedules(config: ParallelConfig, m: int, layers: int,
               opts: SearchOptions) -> list[tuple[str, int]]:
    """Pipeline schedules (and virtual stages) worth costing for this mesh and batch. GPipe
    only when forced: it has 1F1B's bubble and keeps all ``m`` micro-batches in flight where
    1F1B keeps at most ``p``, so it never wins."""
    if config.pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("zero_bubble", 1)]
    if opts.force.get("schedule") == "gpipe":
        out.append(("gpipe", 1))
    for v in (2, 4):
        if config.pp * v <= layers and m % config.pp == 0:
            out += [("interleaved_1f1b", v), ("zero_bubble", v)]
    if config.pp * 2 <= layers:          # the V schedules: two chunks per rank
        out += [("zbv", 2)] + ([("dualpipev", 2)] if m >= 2 * config.pp else [])
    if "schedule" in opts.force:
        out = [s for s in out if s[0] == opts.force["schedule"]]
    elif config.mixed_precision == "params" and config.precision != "fp32":
        # their weight gradients skip the hooks that sum 16-bit weights' fp32 main grads
        out = [s for s in out if s[0] not in SPLIT_BACKWARD]
    if "virtual_stages" in opts.force:
        out = [s for s in out if s[1] == opts.force["virtual_stages"]]
    return out


def optimizer_offloads(config: ParallelConfig, opts: SearchOptions, cluster: Any
                       ) -> tuple[bool, ...]:
    """Whether the optimizer state may go to host memory (``offload_optimizer``): the options'
    choices on GPUs, with pipelines too; not on CPU ranks, whose state is in host memory
    already. Pipeline stages split the model state, but a stage of a deep pipeline at small dp
    still holds 12 bytes of fp32 state per weight that ZeRO-1 cannot shard: offloading it can
    spare the stages their recomputation (GPT-3 175B on 128 A100: dp1 tp8 pp16 with the
    optimizer offloaded, 176.3 s, beats the dp128 ZeRO-3 plan's 182.4 s, which recomputes
    nearly every layer; ``benchmarks/memory_options.py``)."""
    return (False,) if cluster.device.kind == "cpu" else tuple(opts.offload_optimizer)


# a pipelined config's optimizer state is offered for offload where it takes at least this share
# of the device's memory: less cannot spare a stage much recomputation (the search prices the
# twins it offers, the host's step and copies included)
OFFLOAD_MIN_MEMORY_SHARE = 0.05


def offload_frees_enough(config: ParallelConfig, zero_stage: int, cluster: Any,
                         graph: OpGraph, opts: SearchOptions) -> bool:
    """Whether offloading ``config``'s optimizer state at ``zero_stage`` may pay: without
    pipelines always (``estimate`` weighs it), with them where the state a rank would move to
    the host, its share of the model's optimizer bytes under ZeRO (an average stage's), is at
    least ``OFFLOAD_MIN_MEMORY_SHARE`` of the device's memory, and not at ZeRO-0 over dp > 1
    where ZeRO-1 is offered: its offloaded twin holds the same device memory (the whole state on
    the host either way) and steps 1/dp of it there, its updated weights gathered over dp
    where ZeRO-0 all-reduces the gradients (the same bytes); always where forced."""
    if config.pp == 1 or "offload_optimizer" in opts.force:
        return True
    if (zero_stage == 0 and config.grad_degree > 1 and 1 in opts.zero_stages
            and "zero_stage" not in opts.force):
        return False
    share = graph.num_params / (config.tp * config.pp)
    kept = model_state_bytes(share, dp=config.shard_degree, zero_stage=zero_stage,
                             precision=config.precision, optimizer=config.optimizer,
                             mixed_precision=config.mixed_precision,
                             optimizer_state=config.optimizer_state)
    return kept.optimizer_bytes >= OFFLOAD_MIN_MEMORY_SHARE * cluster.device.memory_bytes


def offload_twin_needless(est: Any, graph: OpGraph, cluster: Any) -> bool:
    """Whether the optimizer-offloaded twin of pipelined config ``est.config`` (costed, not
    offloaded) cannot be faster: ``est`` fits recomputing nothing in any stage, so the twin's
    freed memory buys nothing, and its device optimizer step (``est.time.optimizer_s``) takes
    no longer than the host's step would on an average stage's share of the weights (a lower
    bound on the twin's host terms: ``estimate/dp_terms.host_terms``, exposed whole)."""
    c = est.config
    if not est.fits or c.offload_optimizer or any(
            c.stage_policy(s) != "none" for s in range(c.pp)) or (
            c.layer_recompute and any(p != "none" for p in c.layer_recompute)):
        return False
    share = graph.num_params / (c.tp * c.pp * (c.shard_degree if c.zero_stage >= 1 else 1))
    return est.time.optimizer_s <= share / cluster.host.cpu_adam_params_per_s


def dp1_zero_stages(zero_options: Sequence[int], offloads: Sequence[bool]) -> tuple[int, ...]:
    """ZeRO stages to try without data parallelism: 0, and 3 where offload is offered, for
    FSDP2's parameter offload, which runs at dp = 1 too (weights and gradients in host memory,
    streamed in layer by layer: ZeRO-Offload/Infinity's way of training a model larger than
    one GPU)."""
    return (0, 3) if 3 in zero_options and True in offloads else (0,)


def recompute_options(opts: SearchOptions, graph: OpGraph,
                      config: ParallelConfig | None = None) -> list[str]:
    """Recomputation policies worth costing. Selective recomputation drops attention scores,
    so a graph without them gains nothing from it; nor is it offered for ``config`` where its
    layers are compiled and hold collectives (``selective_compiles``: ``with_compilation``
    gives such a config an eager twin that may recompute selectively)."""
    recompute = [r for r in opts.recompute if r != "selective" or (
        analyze(graph).score_ops and (config is None or selective_compiles(config))
        and not opts.force.get("offload_activations")
        and not any(opts.force.get("layer_offload") or ()))]
    recompute = [r for r in recompute if r != "ops" or config is None
                 or selective_compiles(config)]
    if "layer_recompute" in opts.force:     # forced per layer: recompute names the strongest
        return [strongest_recompute(opts.force["layer_recompute"])]
    return forced(opts, "recompute", recompute)


def activation_offloads(config: ParallelConfig, opts: SearchOptions, cluster: Any,
                        graph: OpGraph, recompute: str) -> list[int]:
    """Layers per chunk whose saved activations go to host memory
    (``ParallelConfig.offload_activations``): as forced, else none or every layer, offered
    beside recomputation on GPUs (``search_costing.evaluate`` skips it where the same config
    fits without: it only adds copies) without pipelines, where compilation is not forced (the
    hooks cannot sit inside compiled regions: ``policies`` runs an offloading config eagerly)
    and the layers do not recompute selectively (the runtime's hooks cannot reach what selective
    checkpointing keeps). A CPU rank's activations are in host memory already. Offload per
    layer, with pipelines too, is the joint recompute/offload DP's
    (``recompute_choice.refine_recompute``, where ``layer_offload_offered``)."""
    if "offload_activations" in opts.force:
        return [opts.force["offload_activations"]]
    if "layer_offload" in opts.force:       # the user's flags per layer (the config's field)
        return [0]
    layers = sum(len(b.instances) for b in graph.blocks)
    if (cluster.device.kind == "cpu" or config.pp > 1 or opts.force.get("compiled") is True
            or not layers or recompute == "selective" or not opts.offload_activations):
        return [0]
    return [0, layers]


def layer_offload_offered(config: ParallelConfig, opts: SearchOptions, cluster: Any) -> bool:
    """Whether the per-layer DP may offload layers of ``config``: on GPUs (a CPU rank's
    activations are in host memory already), layers not compiled (the hooks would sit inside
    compiled regions), offload allowed and neither of its forms forced."""
    return (cluster.device.kind != "cpu" and not config.compiled and opts.offload_activations
            and "offload_activations" not in opts.force and "layer_offload" not in opts.force)


def selective_compiles(config: ParallelConfig) -> bool:
    """Whether a compiled layer can recompute selectively. torch.compile traces a selectively
    checkpointed layer as one region that must hold no graph break, and the collectives of a
    layer split over tp, cp or ep are graph breaks; compiled inside the checkpoint instead, the
    policy would meet tensors the compiled code reuses (torch refuses: "Tensor cached during
    selective activation checkpoint has been mutated"). Full recomputation runs either way."""
    return not config.compiled or (config.tp == 1 and config.cp == 1 and config.ep == 1)


def with_compilation(c: ParallelConfig, opts: SearchOptions, graph: OpGraph
                     ) -> list[ParallelConfig]:
    """``c`` and the variants compilation leaves runnable. A compiled config whose layers hold
    collectives cannot recompute selectively (``selective_compiles``): unless compilation is
    forced on, a selective one runs eagerly instead, and a pipelined one (whose stages' policies
    the layout search picks later) gets an eager twin that may pick selective ones, so the
    search compares the two and takes the faster."""
    if not c.compiled or selective_compiles(c):
        return [c]
    forced_on = opts.force.get("compiled") is True
    eager = [] if forced_on else [dataclasses.replace(c, compiled=False)]
    chosen = {opts.force.get("recompute")} | set(opts.force.get("stage_recompute") or ())
    wants = bool(_SELECTIVE & chosen)     # "ops" keeps a set too: the same rule as selective
    if c.pp == 1 and c.recompute in _SELECTIVE or wants:
        return eager
    if c.pp > 1 and _SELECTIVE & set(recompute_options(opts, graph)):
        return [c] + eager
    return [c]


# the policies that checkpoint selectively (torch's selective activation checkpointing)
_SELECTIVE = frozenset({"selective", "ops"})


def policies(config: ParallelConfig, opts: SearchOptions, cluster: Any,
              graph: OpGraph, schedules: list[tuple[str, int]] = (("1f1b", 1),)
              ) -> list[ParallelConfig]:
    """Configs to cost for one mesh and micro-batch. Pipelined ones carry the cheapest allowed
    recompute policy as a placeholder: ``search_costing.evaluate`` chooses the stage split and
    each stage's policy (``layout.search_layout``)."""
    out = []
    base = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    recompute = recompute_options(opts, graph)
    if config.pp > 1:
        recompute = recompute[:1]
    # with pipeline stages, ZeRO-2/3 would reduce-scatter and gather every micro-batch
    zero_options = opts.zero_stages if config.pp == 1 else tuple(
        z for z in opts.zero_stages if z <= 1)
    # CPU ranks already keep their optimizer state in host memory: nothing to offload
    offloads = optimizer_offloads(config, opts, cluster)
    zeros = forced(opts, "zero_stage", zero_options if config.grad_degree > 1
                   else dp1_zero_stages(zero_options, offloads))
    for z in zeros:
        for r, acts in ((r, k) for r in recompute
                        for k in activation_offloads(config, opts, cluster, graph, r)):
            for off in forced(opts, "offload_optimizer", offloads):
                if off and not offload_frees_enough(config, z, cluster, graph, opts):
                    continue
                params_off = forced(opts, "offload_params",
                                     (False, True) if z == 3 and True in offloads else (False,))
                for off_p in params_off:
                    if off_p and z != 3:
                        continue   # parameter offload is FSDP's (ZeRO-3)
                    if z == 3 and config.grad_degree == 1 and not off_p \
                            and "zero_stage" not in opts.force:
                        continue   # ZeRO-3 over one rank shards nothing: only its offload
                    for shard in shard_sizes(config, cluster, opts, z):
                        if shard is not None and off_p and "dp_shard" not in opts.force:
                            continue     # offloaded weights: no device memory for HSDP to save
                        for sched, v in schedules:
                            for ep in ep_degrees(config, graph, opts, z, shard is not None):
                                fields = {
                                    **base, "zero_stage": z, "recompute": r,
                                    "offload_optimizer": off, "offload_params": off_p,
                                    "schedule": sched, "virtual_stages": v, "dp_shard": shard,
                                    "ep": ep, "offload_activations": acts,
                                    "compiled": base["compiled"] and not acts}
                                if "dp_whole" in opts.force:    # ZeRO-3's weights kept whole
                                    fields["dp_whole"] = opts.force["dp_whole"]
                                if "layer_recompute" in opts.force:
                                    fields["layer_recompute"] = tuple(
                                        opts.force["layer_recompute"])
                                if "layer_offload" in opts.force:
                                    fields["layer_offload"] = tuple(
                                        opts.force["layer_offload"])
                                try:
                                    c = ParallelConfig(**fields)
                                except ConfigError:
                                    continue    # a forced dp_whole that this one cannot take
                                if (c.split_backward_on_fsdp_unsupported
                                        and "schedule" not in opts.force):
                                    continue   # the runtime refuses it (runtime/trainer.py)
                                for state in optimizer_states(c, opts):
                                    y = dataclasses.replace(c, optimizer_state=state)
                                    for x in storage_and_wire(y, opts, cluster, graph):
                                        out += [v for w in with_compilation(x, opts, graph)
                                                for v in precision_variants(w, opts, cluster)]
    return out


# PowerSGD is offered where the dp group all-reduces slower than this (algorithm bandwidth):
# 100 Gbit/s. Gradient compression pays on slow networks and not on fast ones (Agarwal et al.,
# "On the Utility of Gradient Compression in Distributed Training Systems", MLSys 2022); the
# cost model then weighs it against its products where it is offered.
POWERSGD_MAX_BYTES_PER_S = 12.5e9
# the PowerSGD rank the search offers (Vogels et al. 2019 reach full accuracy with rank 2 on
# ResNet-18 / CIFAR-10 and rank 4 on an LSTM language model); force another with powersgd_rank
POWERSGD_RANK = 4


def storage_and_wire(c: ParallelConfig, opts: SearchOptions, cluster: Any, graph: OpGraph
                     ) -> list[ParallelConfig]:
    """``c`` and its variants with the offloaded state on NVMe (``offload_nvme``: where the
    node has NVMe and its host memory is short) and with PowerSGD compressing the dp
    all-reduce (``grad_compression``: where lossy options are allowed and the network binds);
    a forced value of either field narrows it."""
    out = [c]
    if forced(opts, "offload_nvme", [host_short(c, cluster, graph)])[0]:
        out = [dataclasses.replace(x, offload_nvme=True) for x in out
               if x.offload_optimizer or x.offload_params]
        if "offload_nvme" not in opts.force:
            out = [c] + out
    wants = opts.force.get("grad_compression", "powersgd" if opts.allow_lossy else "none")
    if wants != "none" and compression_runs(c) and (
            "grad_compression" in opts.force or network_binds(c, cluster)):
        rank = opts.force.get("powersgd_rank", POWERSGD_RANK)
        lossy = [dataclasses.replace(x, grad_compression=wants, powersgd_rank=rank)
                 for x in out]
        out = lossy if "grad_compression" in opts.force else out + lossy
    elif wants != "none" and "grad_compression" in opts.force:
        return []
    return out


def host_short(c: ParallelConfig, cluster: Any, graph: OpGraph) -> bool:
    """Whether what ``c`` offloads outgrows a device's share of its node's host memory, on a
    node with NVMe to take it instead."""
    if not (cluster.host.has_nvme and (c.offload_optimizer or c.offload_params)):
        return False
    states = model_state_bytes(_num_params(graph) / (c.tp * c.pp), dp=c.shard_degree,
                               zero_stage=c.zero_stage, precision=c.precision,
                               optimizer=c.optimizer, offload_optimizer=c.offload_optimizer,
                               offload_params=c.offload_params,
                               mixed_precision=c.mixed_precision,
                               optimizer_state=c.optimizer_state)
    return states.offloaded_bytes > cluster.host.memory_bytes / cluster.devices_per_node


def _num_params(graph: OpGraph) -> int:
    """``graph.num_params`` (a sum over every parameter), kept on the graph: asked per
    offloading config."""
    n = graph.__dict__.get("_autoplan_num_params")
    if n is None:
        n = graph.__dict__["_autoplan_num_params"] = graph.num_params
    return n


def compression_runs(c: ParallelConfig) -> bool:
    """Whether DDP's PowerSGD hook can take ``c``'s gradient sync (``ParallelConfig``'s
    rule, ``compression_refusal``: DDP over dp > 1, ZeRO-0, no pipeline, no expert
    parallelism, weights not held in 16 bits)."""
    return compression_refusal(c) is None


def network_binds(c: ParallelConfig, cluster: Any) -> bool:
    """Whether ``c``'s dp group all-reduces slower than ``POWERSGD_MAX_BYTES_PER_S``."""
    probe = 2.0 ** 30
    t = cluster.collective_time_s("all_reduce", probe, c.dp_group())
    return t > 0 and probe / t < POWERSGD_MAX_BYTES_PER_S


def auto_precision(cluster: Any) -> str:
    """The 16-bit precision ``precision="auto"`` starts from: bf16 where the device has a bf16
    rate, else fp16 (V100: its runtime scales the loss dynamically, ``runtime/grads.py``)."""
    return "bf16" if "bf16" in cluster.device.peak_flops else "fp16"


def precision_variants(c: ParallelConfig, opts: SearchOptions, cluster: Any
                       ) -> list[ParallelConfig]:
    """``c`` and the precisions the search may also try for it: with ``precision_auto``,
    fp32 where the device's 16-bit rate is no faster (a CPU: autocast would only add casts),
    and fp8 linear layers (``cost/float8.py``, tensorwise and rowwise) on bf16 where the device
    has an fp8 rate, at tp 1 (where the runtime runs them); a forced ``fp8`` on every config
    of tp 1 (or of a forced tp, which the runtime then refuses with its reason). fp16 is not
    tried beside bf16: the same rate, with loss scaling and a narrower range."""
    device = cluster.device
    out = [c]
    if opts.precision_auto and c.precision != "fp32" and c.mixed_precision == "autocast" and (
            device.peak_flops.get("fp32", 0.0) >= device.peak_flops_for(c.precision)):
        out.append(dataclasses.replace(c, precision="fp32"))
    forced_fp8 = opts.force.get("fp8", "none") != "none"
    if c.tp > 1 and "tp" not in opts.force:
        # the runtime runs fp8 linears at tp 1 only (``runtime/float8.float8_refusal``): not
        # offered beside tp, and a forced fp8 is planned on the meshes without it
        return [] if forced_fp8 else out
    recipes = ([opts.force["fp8"]] if "fp8" in opts.force
               else ["tensorwise", "rowwise"] if opts.precision_auto
               and fp8_flops_per_s(device) and c.precision == "bf16" else [])
    skip = tuple(opts.force.get("fp8_skip", ()))     # a forced fp8_skip, else the search's
    recipes = [r for r in recipes
               if r != "none" and c.precision == "bf16" and c.mixed_precision == "autocast"]
    if recipes and opts.force.get("compiled") is False:
        raise ConfigError(f"fp8={recipes[0]!r} needs compiled=True (torchao's float8 training "
                          f"is fast only under torch.compile), but compiled=false is forced: "
                          f"drop --force compiled=false, or drop fp8")
    fp8 = [v for v in (fp8_variant(c, r, skip) for r in recipes) if v is not None]
    return (fp8 if "fp8" in opts.force else out + fp8) or out


def fp8_variant(c: ParallelConfig, recipe: str, skip: tuple[str, ...]
                ) -> ParallelConfig | None:
    """``c`` with its linears in fp8 under ``recipe``: compiled (``check_fp8``: torchao's
    float8 training is only fast under torch.compile), so priced as compiled; None where a
    compiled ``c`` cannot run (activation offload's hooks, or a selective policy in a layer
    split over tp, cp or ep: ``selective_compiles``)."""
    try:
        v = dataclasses.replace(c, fp8=recipe, fp8_skip=skip, compiled=True)
    except ConfigError:
        return None     # offload_activations / layer_offload do not run compiled
    policies = v.stage_recompute or v.layer_recompute or (v.recompute,)
    if not selective_compiles(v) and ({"selective", "ops"} & set(policies)):
        return None
    return v


def optimizer_states(config: ParallelConfig, opts: SearchOptions) -> list[str]:
    """How Adam's moments may be held (``ParallelConfig.optimizer_state``): as forced; else
    fp32 alone unless the user allows lossy options (``allow_lossy``), then also bf16 and
    8-bit for Adam/AdamW. Both change the numerics (rounded or quantised moments), so they are
    never chosen behind the user's back; once allowed, the search takes whichever is fastest
    (8-bit moves the fewest bytes per step and frees the most memory)."""
    if "optimizer_state" in opts.force:
        return [opts.force["optimizer_state"]]
    if not opts.allow_lossy or config.optimizer not in ("adam", "adamw"):
        return ["fp32"]
    return ["fp32", "bf16", "8bit"]


def ep_degrees(config: ParallelConfig, graph: OpGraph, opts: SearchOptions, zero_stage: int,
               excluded: bool) -> list[int]:
    """Expert-parallel degrees to cost: for a model with experts, every ``ep`` dividing both
    dp and the expert count, where the runtime runs it (any ZeRO stage, optimizer and
    parameter offload; ``excluded``: with HSDP, which it does not combine with)."""
    found = find_experts(graph)
    runs = found is not None and not excluded and config.cp == 1
    allowed = [e for e in found.ep_degrees(config.dp) if config.dp % e == 0] if runs else [1]
    if "ep" in opts.force:
        return [opts.force["ep"]] if opts.force["ep"] in allowed else []
    return allowed


def shard_sizes(config: ParallelConfig, cluster: Any, opts: SearchOptions,
                 zero_stage: int) -> list[int | None]:
    """HSDP shard-group sizes to cost for ZeRO-2/3 (None: shard over all of dp): groups of
    whole nodes, up to eight, where they divide dp. A shard group's gathers and reduce-scatters
    take fewer ring steps than the whole dp group's; the replicas all-reduce one shard."""
    hsdp = zero_stage in (2, 3) and config.dp > 1
    if "dp_shard" in opts.force:
        d = opts.force["dp_shard"]
        fits = d is None or hsdp and isinstance(d, int) and 1 < d < config.dp and config.dp % d == 0
        return [d] if fits else []
    if not hsdp:
        return [None]
    node = cluster.devices_per_node
    return [None, *(d for d in range(2, config.dp) if config.dp % d == 0
                    and (d * config.tp) % node == 0 and d * config.tp <= 8 * node)]


def context_degrees(graph: OpGraph, cluster: Any, opts: SearchOptions) -> list[int]:
    """Context-parallel degrees (a cp axis of their own) to search: a forced one, else the
    powers of two up to the cluster where the model's attention runs as ring attention over
    them (``sharding.context_axis``) and each rank keeps a sequence piece of at least
    ``MIN_CP_PIECE`` tokens (shorter pieces cannot hide the ring's passes behind their
    attention, and more data parallelism does the same work with no ring)."""
    if "cp" in opts.force:
        cp = opts.force["cp"]
        if cp != 1:                         # ConfigError: why the model cannot take it
            context_axis(graph, cp, opts.force.get("cp_layout", "contiguous"))
        return [cp]
    seq = sequence_length(graph)
    out, c = [], 2
    while c <= cluster.world_size and seq is not None and seq // c >= MIN_CP_PIECE:
        try:
            context_axis(graph, c)
        except ConfigError:
            break
        out.append(c)
        c *= 2
    return out


def context_layout(graph: OpGraph, cp: int, opts: SearchOptions) -> str:
    """How a ``cp``-way axis lays the sequence out (``ParallelConfig.cp_layout``): as forced,
    else ``zigzag`` where the model has causal ring attention and its split dims cut into
    ``2 cp`` chunks, else ``contiguous``. Not searched: the two move the same bytes and zigzag
    never does more attention work on any rank (``sharding/ring_work.py``), so it wins
    wherever the work differs, and contiguous stays where it does not (no causal mask). Under
    packed documents (``seq_lengths``) the layout whose ring has the smaller expected slowest
    step (``doc_work.PackedWork.ring_share``), zigzag on a tie."""
    if "cp_layout" in opts.force:
        return opts.force["cp_layout"]
    if cp == 1:
        return "contiguous"
    ax = context_axis(graph, cp)
    if ax is None:
        return "contiguous"
    causal = any(ax.causal(i) for i in ax.rings())
    if opts.seq_lengths is not None and opts.seq_lengths.seq_len % (2 * cp) == 0 and (
            opts.seq_lengths.ring_share(cp, "contiguous", causal)
            < opts.seq_lengths.ring_share(cp, "zigzag", causal)):
        return "contiguous"
    if not causal and opts.seq_lengths is None:
        return "contiguous"
    try:
        context_axis(graph, cp, "zigzag")
    except ConfigError:
        return "contiguous"
    return "zigzag"


# the shortest sequence piece a context-parallel rank is offered (``context_degrees``)
MIN_CP_PIECE = 2048


def sequence_length(graph: OpGraph) -> int | None:
    """The sequence length of the model's attention (its query's dim 2), None without one."""
    for op in graph.ops:
        if is_attention(op):
            shape = graph.value(op.inputs[0]).meta.shape
            if len(shape) == 4:
                return shape[2]
    return None
