"""What data parallelism adds to a pipeline stage's step, as terms both ``estimate`` and the
sharding ILP price: the dp group's gradient sync, ZeRO's parameter gathers, the optimizer step
and host traffic.

Each term is some seconds of work (a collective, the optimizer, a copy to the host), hidden
behind the stage's forward or backward compute as far as it lasts (``overlap_exposed_s``), or
exposed whole. The seconds depend on the parameters the stage's ranks hold, which the tensor-
parallel sharding decides (a weight split over tp holds 1/tp of its elements on each rank): the
ILP takes each term as a function of them (``planner/dp_problem.py``), the estimate at the
sharding it is given. One definition, so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.cost.compute import ComputeModel
from autoplan.cost.float8 import gather_scale_work
from autoplan.cost.dtypes import autocast_on
from autoplan.cost.memory import GRAD_BYTES, MOMENT_BYTES, PRECISION_BYTES, bytes_per_param
from autoplan.cost.powersgd import ERROR_FEEDBACK_PASSES, powersgd_cost
from autoplan.estimate.overlap import overlap_exposed_s
from autoplan.graph.analysis import reads_tables
from autoplan.sharding.parallel_config import ParallelConfig

# Bytes an optimizer step reads and writes per parameter (grad, weights, states; Adam keeps
# fp32 master + two moments under mixed precision). The step is memory-bound.
OPT_STEP_BYTES = {"adamw": 28, "adam": 28, "sgd": 20}
# How many times slower the host's optimizer step is with Adam's moments in bf16 or 8 bits than
# the fp32 CPU Adam the host's rate (``cpu_adam_params_per_s``) describes: torchao's steps on CPU
# tensors, as optimizer offload runs them, against torch's fused fp32 AdamW on the same tensors
# (``python benchmarks/host_adam_states.py``: 8-bit 15.5-18.7x, bf16 1.3-2.0x over three runs
# on this project's CPU, ``benchmarks/data/host_adam_states.txt``). Unlike a GPU's, a CPU's
# 8-bit step is bound by its per-element search of the code map, not by the bytes it moves.
HOST_STEP_SLOWDOWN = {"fp32": 1.0, "bf16": 1.7, "8bit": 17.0}


@dataclass(frozen=True)
class StageParams:
    """The parameters one rank of a pipeline stage holds (after tp and ep sharding)."""

    params: float            # elements
    experts: float = 0.0     # of ``params``, expert slabs (their gradients go over edp)
    layer_params: float = 0.0   # of ``params``, those inside the stage's layers
    tensors: int = 0         # parameter tensors (the optimizer's per-tensor cost)
    layers: int = 1          # the stage's layers (FSDP's units, DDP's buckets)
    whole: float = 0.0       # of ``params``, weights ZeRO-3 keeps whole (``dp_whole``)
    # of ``params``, the fp8 linears' weights FSDP gathers in fp8 (``cost/float8.py``:
    # ``fp8_gathered_weights``), and how many tensors they are
    fp8: float = 0.0
    fp8_tensors: int = 0


@dataclass(frozen=True)
class Term:
    """``times`` x the seconds ``seconds`` add to the step: behind the ``window`` phase's compute
    ("fwd", "bwd": at least ``first_s`` exposed, then the overlap's interference), or whole
    (""). ``shares``: how the exposed time is reported (the estimate's breakdown keys)."""

    seconds: float
    window: str = ""
    first_s: float = 0.0
    times: float = 1.0
    shares: tuple[tuple[str, float], ...] = ()
    whole_only: bool = False     # there only where some weights are kept whole (ILP: a charge)

    def exposed_s(self, fwd_s: float, bwd_s: float, interference: float) -> float:
        if not self.window:
            return self.times * self.seconds
        window = fwd_s if self.window == "fwd" else bwd_s
        return self.times * overlap_exposed_s(self.seconds, window, self.first_s, interference)


def stage_terms(config: ParallelConfig, cluster: Any, stage: StageParams, m: int,
                pp_index: int, compute: ComputeModel, profile: Any, *,
                simulated: bool = False) -> list[Term]:
    """The dp, ZeRO, optimizer and offload terms of stage ``pp_index``'s step (``m``
    micro-batches; ``compute`` and ``profile`` price the optimizer on the device).
    ``simulated``: the pipeline simulator runs the gradient sync and FSDP's traffic, so they
    are left out here."""
    out: list[Term] = []
    params, experts, layers, whole = stage.params, stage.experts, stage.layers, stage.whole
    # FSDP's gathers, reduce-scatters and host copies run in every micro-batch, but under
    # dp_shares once a step: the weights gathered in the first forward, the gradients
    # reduce-scattered (ZeRO-3: the weights gathered again) in the last backward
    # (runtime/steps.fsdp_once_a_step), whatever the rank's share
    fsdp_times = 1 if config.dp_shares is not None else m
    outside32 = fp32_gathered(config, params - whole, stage.layer_params,
                              reads_tables(compute.graph))
    grad_sync, ag, rs = dp_collectives(config, cluster, params - whole, layers, pp_index,
                                       experts, fp8_params=stage.fp8, fp32_params=outside32)
    if config.grad_compression == "powersgd" and grad_sync > 0:
        # DDP's PowerSGD hook: the factors all-reduced instead, behind the backward as the
        # buckets are; its products run on the compute stream, exposed
        grad_sync, compress_s = powersgd_s(config, cluster, compute, params - whole, pp_index)
        out.append(Term(compress_s, shares=(("dp_grad_sync", 1.0),)))
    if config.dp > 1 and config.zero_stage in (1, 2):   # updated shards, after the step
        out.append(_updated_shards_term(config, cluster, stage, pp_index, outside32))
    if not simulated:                # else the simulator runs the syncs and FSDP's traffic
        if grad_sync > 0:
            # the dp group's gradient sync (DDP's buckets) hidden behind the last
            # micro-batch's backward as far as it lasts; ZeRO-2's behind every backward
            out.append(Term(grad_sync, "bwd", grad_sync / layers,
                            reduce_scatters_per_step(config, m),
                            shares=(("dp_grad_sync", 1.0),)))
        if ag + rs > 0:              # FSDP, each phase's traffic behind its compute
            # (under a pipeline: a gather for every forward, for the first backward only and
            # one reduce-scatter, as torch's schedule runs them: ``pipeline_timing``)
            bwd_times = 1 if config.pp > 1 else fsdp_times
            out.append(Term(layers * ag, "fwd", ag, fsdp_times, (("zero_param_gather", 1.0),)))
            share = ag / (ag + rs)
            out.append(Term(layers * (ag + rs), "bwd", ag + rs, bwd_times,
                            (("zero_param_gather", share), ("dp_grad_sync", 1.0 - share))))
    if stage.fp8:
        out.append(fp8_gather_term(config, cluster, stage, pp_index, compute, fsdp_times))
    if whole:
        # weights ZeRO-3 keeps whole: their gradients all-reduced over dp once a step in
        # buckets behind the last micro-batch's backward, as DDP's (runtime/optim.py
        # DataParallelGrads)
        sync = cluster.collective_time_s("all_reduce", whole * GRAD_BYTES,
                                         config.dp_group(pp_index=pp_index))
        out.append(Term(sync, "bwd", sync / layers, shares=(("dp_grad_sync", 1.0),),
                        whole_only=True))
    # the parameters this rank steps: its ZeRO shard; expert slabs sharded over the ranks
    # holding the same experts; the weights kept whole
    owned = ((params - experts - whole) / (config.shard_degree if config.zero_stage >= 1 else 1)
             + experts / (config.dp // config.ep if config.zero_stage >= 1 else 1) + whole)
    if config.offload_params or config.offload_optimizer:
        out += host_terms(config, cluster, owned, fsdp_times, layers)
    else:
        out.append(Term(optimizer_step_s(owned, stage.tensors, config, compute, profile),
                        shares=(("optimizer", 1.0),)))
    return out


def reduce_scatters_per_step(config: ParallelConfig, m: int) -> int:
    """How many times a step reduces a stage's gradients over dp: once (DDP and ZeRO-1 hold
    them back to the last micro-batch; FSDP2 under a pipeline, where torch's schedule reduces
    them after its last backward, and under ``dp_shares``, ``runtime/steps.fsdp_once_a_step``),
    but ZeRO-2 without either reduce-scatters each of the ``m`` micro-batches' gradients into
    their shards in its backward: sharded gradients are what ZeRO-2 is for (DeepSpeed's stage 2
    reduces after every backward for that reason, deepspeedai/DeepSpeed#2252), where
    accumulating them whole would hold ZeRO-1's gradient memory (``runtime/parallelize.keep_gathered``: the weights are still gathered once)."""
    if (config.zero_stage == 2 and config.pp == 1 and config.dp_shares is None
            and config.uses_fsdp):
        return m
    return 1


# bytes per element of a weight FSDP gathers in fp8 (torchao's enable_fsdp_float8_all_gather)
FP8_GATHER_BYTES = 1


def fp8_gather_term(config: ParallelConfig, cluster: Any, stage: StageParams, pp_index: int,
                    compute: ComputeModel, times: int) -> Term:
    """The device work FSDP's fp8 all-gather adds (``cost/float8.gather_scale_work``): each
    gather's casts of the shards to fp8 (ZeRO-3 gathers every layer for its forward and again
    for its backward, ZeRO-2 once, ``times`` a step) and, once a step, the amaxes of this
    rank's shards and their all-reduce over the shard group. On the compute stream: exposed."""
    owned = stage.fp8 / config.shard_degree
    amax_s = cluster.collective_time_s("all_reduce", 4.0 * stage.fp8_tensors,
                                       config.dp_shard_group(pp_index=pp_index))
    work = gather_scale_work(owned, stage.fp8_tensors, stage.layers,
                             memory_bytes_per_s=compute.tput.memory_bytes_per_s,
                             launch_s=compute.tput.launch_s, amax_all_reduce_s=amax_s)
    gathers = stage.layers * (2 if config.zero_stage == 3 else 1) * times
    return Term(gathers * work.per_gather_s + work.per_step_s,
                shares=(("zero_param_gather", 1.0),))


def host_terms(config: ParallelConfig, cluster: Any, owned: float, times: int, layers: int
               ) -> list[Term]:
    """Offload's terms for the ``owned`` parameters this rank steps: the host's optimizer
    step, the copies over the host link and (``offload_nvme``) the NVMe traffic. Parameter
    offload copies the weight shards up for the forward and again for the backward gather,
    and the gradient shards down, ``times`` a step (every micro-batch; under dp_shares once,
    for the first forward and the last backward)."""
    host, w_bytes = cluster.host, PRECISION_BYTES[config.precision]
    out = [Term(host_step_s(owned, config, host), shares=(("optimizer", 1.0),))]
    if config.offload_params:
        moved = times * owned * (2 * w_bytes + w_bytes)
    else:
        moved = owned * (w_bytes + w_bytes)          # grads down, weights up
    out.append(Term(moved / host.device_to_host_bandwidth_bytes_per_s,
                    shares=(("offload", 1.0),)))
    if config.offload_nvme:
        out += nvme_terms(config, cluster, owned, times, layers)
    return out


def powersgd_s(config: ParallelConfig, cluster: Any, compute: ComputeModel, params: float,
               pp_index: int) -> tuple[float, float]:
    """(all-reduce seconds, compression seconds) of one step's rank-``powersgd_rank`` PowerSGD
    (``cost/powersgd.py``) over the ``params`` gradient elements this rank holds: the
    uncompressed gradients, the P factors and the Q factors all-reduced one after the other
    (fp32), and the products, orthogonalisation and error feedback on the device (fp32
    products at the device's fp32 rate)."""
    c = powersgd_cost(compute.graph, config.powersgd_rank)
    share = params / max(c.elements, 1.0)       # this rank's part (tensor parallelism)
    group = config.dp_group(pp_index=pp_index)
    sync = sum(cluster.collective_time_s("all_reduce", e * share * GRAD_BYTES, group)
               for e in (c.whole_elements, c.p_elements, c.q_elements) if e > 0)
    tput = compute.tput
    fp32_rate = tput.fp32_matmul_flops_per_s or tput.matmul_flops_per_s
    work_s = share * (c.flops / fp32_rate + c.compressed_elements * ERROR_FEEDBACK_PASSES
                      * GRAD_BYTES / tput.memory_bytes_per_s)
    # per compressed gradient: three products, the copies, r Gram-Schmidt steps
    launches = c.matrices * (6 + 2 * config.powersgd_rank)
    return sync, work_s + launches * tput.launch_s


def nvme_terms(config: ParallelConfig, cluster: Any, owned: float, m: int, layers: int
               ) -> list[Term]:
    """ZeRO-Infinity's NVMe traffic for the ``owned`` parameters this rank steps (its share of
    the node's drives: ``1 / devices_per_node`` of their rates). The optimizer state (and, with
    parameter offload, the weights and gradients) is read from NVMe and written back once a
    step, pipelined with the CPU optimizer (the slower of the two counts: the host link term
    prices the rest). With parameter offload each micro-batch reads the weight shards again
    for its forward and its backward, prefetched a layer ahead: hidden behind that phase's
    compute but for the first layer's read (Rajbhandari et al. 2021, Sec. 6)."""
    host, share = cluster.host, cluster.devices_per_node
    read_bw = host.nvme_read_bytes_per_s / share
    write_bw = host.nvme_write_bytes_per_s / share
    w, g, o = bytes_per_param(config.precision, config.optimizer, config.mixed_precision,
                              config.optimizer_state)
    read = o + (w + g if config.offload_params else 0)
    write = o + (w if config.offload_params else 0)
    swap_s = owned * (read / read_bw + write / write_bw)
    adam_s = host_step_s(owned, config, host)          # priced by the optimizer term
    out = [Term(max(0.0, swap_s - adam_s), shares=(("offload", 1.0),))]
    if config.offload_params:
        stream = owned * w / read_bw
        out += [Term(stream, "fwd", stream / layers, m, (("offload", 1.0),)),
                Term(stream, "bwd", stream / layers, m, (("offload", 1.0),))]
    return out


def host_step_s(owned: float, config: ParallelConfig, host: Any) -> float:
    """Seconds of the host's optimizer step over ``owned`` parameters: its CPU-Adam rate, slowed
    by ``HOST_STEP_SLOWDOWN`` where Adam's moments are held in bf16 or 8 bits."""
    return owned / host.cpu_adam_params_per_s * HOST_STEP_SLOWDOWN[config.optimizer_state]


def price(terms: list[Term], fwd_s: float, bwd_s: float, interference: float
          ) -> dict[str, float]:
    """Exposed seconds per breakdown key ("dp_grad_sync", "zero_param_gather", "optimizer",
    "offload") of ``terms`` on a stage whose forward and backward last ``fwd_s``, ``bwd_s``."""
    out = {"dp_grad_sync": 0.0, "zero_param_gather": 0.0, "optimizer": 0.0, "offload": 0.0}
    for t in terms:
        x = t.exposed_s(fwd_s, bwd_s, interference)
        for key, share in t.shares:
            out[key] += x * share
    return out


def _updated_shards_term(config: ParallelConfig, cluster: Any, stage: StageParams,
                         pp_index: int, outside32: float) -> Term:
    """ZeRO-1/2's gather of the updated weight shards after the step (``outside32``: of the
    stage's weights, those FSDP gathers in fp32, ``fp32_gathered``)."""
    params, experts, layers = stage.params, stage.experts, stage.layers
    w_bytes = PRECISION_BYTES[config.precision]
    # ZeRO-1 broadcasts the weights as the model holds them: fp32 under autocast (the
    # runtime's), 16-bit where they are held in the training precision (Megatron-LM's
    # distributed optimizer gathers its bf16 weights); FSDP2 (ZeRO-2) gathers them in
    # the training precision
    gathered = (PRECISION_BYTES["fp32"]
                if config.zero_stage == 1 and config.mixed_precision == "autocast"
                else w_bytes)
    fp32 = outside32 if config.zero_stage == 2 else 0.0
    gather = cluster.collective_time_s("all_gather", (params - experts - stage.fp8 - fp32)
                                       * gathered + fp32 * PRECISION_BYTES["fp32"]
                                       + stage.fp8 * FP8_GATHER_BYTES,
                                       config.dp_shard_group(pp_index=pp_index))
    if experts:
        gather += cluster.collective_time_s("all_gather", experts * gathered,
                                            config.expert_dp_group(pp_index=pp_index))
    if config.zero_stage == 1:
        # the runtime issues them after the step and waits for each before the module that
        # reads it (Megatron-LM's --overlap-param-gather): hidden behind the next forward
        # but for what the first modules need (the weights outside layers, one layer)
        lp = stage.layer_params
        first = gather * (params - lp + lp / layers) / max(params, 1.0)
        return Term(gather, "fwd", first, shares=(("zero_param_gather", 1.0),))
    return Term(gather, shares=(("zero_param_gather", 1.0),))


def fp32_gathered(config: ParallelConfig, params: float, layer_params: float,
                  tables: bool = True) -> float:
    """Of ``params``, those FSDP gathers in fp32 though the training is 16-bit: under autocast
    the weights outside the layers where the model reads a table (``tables``: an embedding's,
    ``graph.analysis.reads_tables``; ``runtime/autocast_weights``), wherever they are; none
    where it reads none (its root unit is gathered in 16 bits)."""
    if not (tables and config.uses_fsdp
            and autocast_on(config.precision, config.mixed_precision)):
        return 0.0
    return max(0.0, params - layer_params)


def dp_collectives(config: ParallelConfig, cluster: Any, params: float, layers: int,
                   pp_index: int, expert_params: float = 0.0, *, fp8_params: float = 0.0,
                   fp32_params: float = 0.0) -> tuple[float, float, float]:
    """Seconds of stage ``pp_index``'s dp collectives for ``params`` parameters in ``layers``
    layers: (per-step gradient reduction, per-layer gather, per-layer reduce-scatter). FSDP
    (ZeRO-3) gathers each layer before its forward and again before its backward, then
    reduce-scatters its gradients, every micro-batch (the runtime does not skip gradient sync
    between micro-batches, but under ``dp_shares``: ``stage_terms`` counts them once); ZeRO-0
    all-reduces the gradients once a step, ZeRO-1 reduce-scatters them once a step, ZeRO-2
    ``reduce_scatters_per_step`` times. ``fp8_params`` of ``params`` are gathered in fp8 (one
    byte per element: ``cost/float8.py``), ``fp32_params`` in fp32 (``fp32_gathered``), their
    gradients reduced as the rest. Under HSDP the
    gathers and reduce-scatters span a shard group and each reduced shard is then all-reduced
    over the replicas holding it (FSDP2 on a 2-D mesh).
    Under expert parallelism the ``expert_params`` of ``params`` go over the ranks holding the
    same experts (dp / ep of them): all-reduced once a step under ZeRO-0/1, gathered and
    reduce-scattered like the rest under FSDP (ZeRO-2/3), which shards them there."""
    if config.dp == 1:
        return 0.0, 0.0, 0.0
    w_bytes = PRECISION_BYTES[config.precision]
    shard = config.dp_shard_group(pp_index=pp_index)
    edp = config.expert_dp_group(pp_index=pp_index) if config.ep > 1 else shard
    experts, params = (expert_params, params - expert_params) if config.ep > 1 else (0.0, params)

    def reduce(nbytes: float, experts_bytes: float) -> float:
        t = cluster.collective_time_s("reduce_scatter", nbytes, shard)
        if config.dp_shard is not None:
            t += cluster.collective_time_s("all_reduce", nbytes / config.dp_shard,
                                           config.dp_replicate_group(pp_index=pp_index))
        if experts_bytes:
            t += cluster.collective_time_s("reduce_scatter", experts_bytes, edp)
        return t
    if config.zero_stage == 3:
        layer_bytes = ((params - fp8_params - fp32_params) * w_bytes
                       + fp32_params * PRECISION_BYTES["fp32"]
                       + fp8_params * FP8_GATHER_BYTES) / layers
        expert_bytes = experts * w_bytes / layers
        gather = cluster.collective_time_s("all_gather", layer_bytes, shard)
        if expert_bytes:
            gather += cluster.collective_time_s("all_gather", expert_bytes, edp)
        return (0.0, gather, reduce(params * GRAD_BYTES / layers,
                                    experts * GRAD_BYTES / layers))
    if config.zero_stage == 2:
        return reduce(params * GRAD_BYTES, experts * GRAD_BYTES), 0.0, 0.0
    experts_s = (cluster.collective_time_s("all_reduce", experts * GRAD_BYTES, edp)
                 if experts else 0.0)
    if config.zero_stage == 0:
        return (experts_s + cluster.collective_time_s("all_reduce", params * GRAD_BYTES,
                                                      config.dp_group(pp_index=pp_index)),
                0.0, 0.0)
    return experts_s + reduce(params * GRAD_BYTES, 0.0), 0.0, 0.0


def optimizer_step_s(params: float, tensors: int, config: ParallelConfig,
                     compute: ComputeModel, profile: Any) -> float:
    """Measured AdamW rates where calibrated (per parameter + per tensor), else memory-bound."""
    cal = getattr(profile, "calibration", None)
    if cal is not None and config.optimizer in ("adam", "adamw"):
        # measured with fp32 moments: a low-bit step scaled by the bytes it moves
        share = step_bytes_per_param(config) / OPT_STEP_BYTES[config.optimizer]
        return (params * cal.optimizer_s_per_param * share
                + tensors * cal.optimizer_s_per_tensor) * compute.slowdown
    return (params * step_bytes_per_param(config) / compute.tput.memory_bytes_per_s
            + tensors * compute.tput.launch_s)


def step_bytes_per_param(config: ParallelConfig) -> float:
    """Bytes the optimizer step reads and writes per parameter: ``OPT_STEP_BYTES``, with
    Adam's two moments read and written in their held form (``optimizer_state``: bf16, or
    torchao's 8-bit codes and per-block scales). torchao's step is one compiled kernel per
    tensor that dequantises, updates in fp32 and quantises in registers (its binary search
    over the 256-entry code map is some 50 operations per element, under an H100's 20 per
    byte moved), so the step stays memory-bound and costs the bytes it moves."""
    moments = MOMENT_BYTES[config.optimizer_state] - MOMENT_BYTES["fp32"]
    return OPT_STEP_BYTES[config.optimizer] + 2 * moments
