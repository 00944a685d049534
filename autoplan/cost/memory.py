"""Memory per device: model states (ZeRO) and the activations backward keeps (with liveness).

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1/5): with mixed precision and Adam a
parameter costs 2 (16-bit weight) + 2 (16-bit gradient) + 12 (fp32 master weight, momentum,
variance) bytes; ZeRO-1 shards the 12 over the data-parallel group, ZeRO-2 also the gradients,
ZeRO-3 also the weights. In fp32 there is no master copy (4 + 4 + 8 for Adam).

Activations: the tensors each op keeps for backward (``Op.saved``, ``Op.saved_internal``, set
by the op rules at trace time), counted once per storage (views share their base), scaled from
the traced batch to the micro-batch, converted to the training precision, and divided by the
tensor-parallel degree where TP (or sequence parallelism) splits them. Recompute policies:
``selective`` drops what the attention-score region keeps (it is recomputed), ``full`` keeps
only each block's input, ``ops`` keeps each block's input and the outputs of its products
(matmuls, attention, convolutions), which selective checkpointing stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.cost.dtypes import HeldBytes, autocast_on, own_sizes
from autoplan.graph.analysis import analyze
from autoplan.errors import ConfigError
from autoplan.graph.opgraph import OpGraph, TensorMeta
from autoplan.graph.oprules import OPS_POLICY_SAVES
from autoplan.sharding.parallel_config import MIXED_PRECISION
from autoplan.sharding.placement import REPLICATE, Placement
from autoplan.sharding.sharding import Sharding, megatron_sharding

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Gradients are reduced in fp32 whatever the training precision: autocast keeps fp32 weights
# (so fp32 gradients) and FSDP2's MixedPrecisionPolicy reduces in fp32 (runtime/trainer.py), as
# Megatron-LM does for bf16 (arguments.py forces accumulate_allreduce_grads_in_fp32).
GRAD_BYTES = 4

# bytes per parameter of optimizer state kept by the optimizer (fp32), excluding any master copy
_OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd": 4}
# bytes per parameter of Adam's two moments as ``ParallelConfig.optimizer_state`` holds them:
# fp32; bf16 (Megatron-Core's precision-aware optimizer, --exp-avg-dtype/--exp-avg-sq-dtype
# bf16); 8-bit codes with one fp32 scale per block of 256 elements (torchao.optim.AdamW8bit's
# default block_size, torchao/optim/adam.py; Dettmers et al. 2022, "8-bit Optimizers via
# Block-wise Quantization", Sec. 2). torchao keeps fp32 moments for tensors under 4,096
# elements (norms, biases: under 0.1 % of an LLM's parameters), not counted here
MOMENT_BYTES = {"fp32": 8.0, "bf16": 4.0, "8bit": 2 * (1 + 4 / 256)}


@dataclass(frozen=True, kw_only=True)
class ModelStateBytes:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float          # on the device (0 when offloaded)
    offloaded_bytes: float = 0.0    # optimizer state kept in host memory instead
    nvme_bytes: float = 0.0         # what is offloaded to NVMe instead (``offload_nvme``)

    @property
    def total_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes


def bytes_per_param(precision: str, optimizer: str, mixed_precision: str = "params",
                    optimizer_state: str = "fp32") -> tuple[int, int, float]:
    """(weight, gradient, optimizer-state) bytes per parameter for this precision and optimizer.
    ``mixed_precision="params"``: 16-bit weights and gradients, the fp32 master copy with the
    optimizer state; ``"autocast"`` (autoplan's runtime): fp32 weights and gradients, no master
    copy (``model_state_bytes`` adds autocast's 16-bit weight copies). ``optimizer_state``:
    Adam's moments in bf16 or 8 bits (``MOMENT_BYTES``); the master copy stays fp32."""
    if precision not in PRECISION_BYTES:
        raise ConfigError(f"precision must be one of {sorted(PRECISION_BYTES)}, got {precision!r}")
    if optimizer not in _OPTIMIZER_STATE_BYTES:
        raise ConfigError(f"optimizer must be one of {sorted(_OPTIMIZER_STATE_BYTES)}, "
                          f"got {optimizer!r}")
    if mixed_precision not in MIXED_PRECISION:
        raise ConfigError(f"mixed_precision must be one of {list(MIXED_PRECISION)}, got "
                          f"{mixed_precision!r}")
    if optimizer_state not in MOMENT_BYTES or optimizer_state != "fp32" and optimizer == "sgd":
        raise ConfigError(f"optimizer_state must be one of {list(MOMENT_BYTES)} (not fp32 "
                          f"for Adam/AdamW only), got {optimizer_state!r} with {optimizer!r}")
    state = (_OPTIMIZER_STATE_BYTES[optimizer] if optimizer_state == "fp32"
             else MOMENT_BYTES[optimizer_state])
    if autocast_on(precision, mixed_precision):
        return 4, 4, state
    w = PRECISION_BYTES[precision]
    master = 4 if precision != "fp32" else 0      # fp32 master weights under mixed precision
    return w, w, state + master


def model_state_bytes(num_params: float, *, dp: int, zero_stage: int, precision: str,
                      optimizer: str = "adamw", offload_optimizer: bool = False,
                      offload_params: bool = False, mixed_precision: str = "params",
                      offload_nvme: bool = False, optimizer_state: str = "fp32"
                      ) -> ModelStateBytes:
    """Per-device bytes of weights, gradients and optimizer state for ``num_params`` parameters
    held by one data-parallel replica slot (already divided by TP/PP by the caller).

    Under autocast (``mixed_precision="autocast"``, 16-bit ``precision``) the weights are fp32
    and the weights' bytes include the 16-bit copies that stand beside them from a forward to
    its backward: autocast's casts for the products (ZeRO 0 and 1), or FSDP's unsharded
    16-bit weights kept after the forward (ZeRO-2); ZeRO-3 gathers them per layer (a
    transient the estimate adds). ``offload_nvme``: what is offloaded lives on NVMe
    (``nvme_bytes``), not in host memory (the estimate adds the host buffers it streams
    through)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage must be 0-3, got {zero_stage!r}")
    w, g, o = bytes_per_param(precision, optimizer, mixed_precision, optimizer_state)
    autocast = autocast_on(precision, mixed_precision)
    opt = num_params * o / (dp if zero_stage >= 1 else 1)
    grads = num_params * g / (dp if zero_stage >= 2 else 1)
    # the runtime's FSDP (ZeRO-2 and 3) shards its fp32 weights themselves
    params = num_params * w / (dp if zero_stage >= (2 if autocast else 3) else 1)
    params += autocast_copy_bytes(num_params, precision=precision,
                                  mixed_precision=mixed_precision, zero_stage=zero_stage,
                                  offload_params=offload_params)
    if offload_params:        # FSDP CPU offload: sharded weights, grads and state on the host
        return _offloaded(ModelStateBytes(params_bytes=0.0, grads_bytes=0.0,
                                          optimizer_bytes=0.0,
                                          offloaded_bytes=params + grads + opt), offload_nvme)
    if offload_optimizer:
        return _offloaded(ModelStateBytes(params_bytes=params, grads_bytes=grads,
                                          optimizer_bytes=0.0, offloaded_bytes=opt),
                          offload_nvme)
    return ModelStateBytes(params_bytes=params, grads_bytes=grads, optimizer_bytes=opt)


def autocast_copy_bytes(num_params: float, *, precision: str, mixed_precision: str,
                        zero_stage: int, offload_params: bool = False) -> float:
    """The part of ``model_state_bytes``' weights that is autocast's 16-bit copies of
    ``num_params`` fp32 weights, standing beside them from a forward to its backward (ZeRO 0
    to 2; ZeRO-3 gathers them per layer, a transient). They are made by each step, not held
    between steps: what a rank holds between steps is the rest."""
    if (autocast_on(precision, mixed_precision) and zero_stage < 3 and not offload_params):
        return num_params * PRECISION_BYTES[precision]
    return 0.0


def unsharded_step_bytes(num_params: float, *, precision: str, zero_stage: int,
                         offload_params: bool = False) -> tuple[float, float]:
    """(weights, gradients) bytes FSDP2 holds unsharded through a whole step where it meets
    its dp peers once a step (``holds_step_whole``: ``dp_shares``, pipelines), on a rank
    running two micro-batches or more, for the ``num_params`` parameters it shards. The
    gradients are accumulated unsharded in fp32 (its reduce dtype, ``GRAD_BYTES``) from the
    first backward to the last one's reduce-scatter, on the device even under parameter
    offload. Under ZeRO-3 and parameter offload the weights gathered in the training precision
    (``MixedPrecisionPolicy.param_dtype``) in the first forward stay on the device until the
    last micro-batch; ZeRO-2 keeps them from each forward to its backward anyway, as
    ``model_state_bytes`` counts, so they add nothing there."""
    gathers = zero_stage == 3 or offload_params
    weights = num_params * PRECISION_BYTES[precision] if gathers else 0.0
    return weights, num_params * GRAD_BYTES


def holds_step_whole(state_config: Any, m: int) -> bool:
    """Whether FSDP2 holds a stage's state unsharded for the whole step on its busiest rank
    (``unsharded_step_bytes``): where it meets its peers once a step, a rank of ``m`` >= 2
    micro-batches keeps it from its first micro-batch to its last backward (with one it runs
    as an even config without a pipeline does). FSDP2 meets them once a step under
    ``dp_shares`` (``runtime/steps.fsdp_once_a_step``) and under a pipeline: torch's schedule
    runs every backward without gradient sync or reshard and reduces after the last
    (``PipelineStage.backward_maybe_with_nosync``, ``perform_reduce_grad``).
    ``state_config``: ``ParallelConfig.grad_view()``."""
    once = state_config.dp_shares is not None or state_config.pp > 1
    return once and state_config.uses_fsdp and m >= 2


def step_whole_states(states: ModelStateBytes, params: float, config: Any,
                      shard_degree: int) -> ModelStateBytes:
    """``states`` with the ``params`` FSDP shards (over ``shard_degree`` ranks) held unsharded
    for the step (``unsharded_step_bytes``): whole gradients in place of their shard, the
    gathered weights beside their shard (ZeRO-3, parameter offload)."""
    shard = model_state_bytes(params, dp=shard_degree, zero_stage=config.zero_stage,
                              precision=config.precision, optimizer=config.optimizer,
                              offload_params=config.offload_params,
                              mixed_precision=config.mixed_precision,
                              optimizer_state=config.optimizer_state)
    w, g = unsharded_step_bytes(params, precision=config.precision,
                                zero_stage=config.zero_stage,
                                offload_params=config.offload_params)
    return ModelStateBytes(params_bytes=states.params_bytes + w,
                           grads_bytes=states.grads_bytes - shard.grads_bytes + g,
                           optimizer_bytes=states.optimizer_bytes,
                           offloaded_bytes=states.offloaded_bytes,
                           nvme_bytes=states.nvme_bytes)


def _offloaded(states: ModelStateBytes, nvme: bool) -> ModelStateBytes:
    """``states`` with what it offloads moved from host memory to NVMe where ``nvme``."""
    if not nvme:
        return states
    return ModelStateBytes(params_bytes=states.params_bytes, grads_bytes=states.grads_bytes,
                           optimizer_bytes=states.optimizer_bytes, offloaded_bytes=0.0,
                           nvme_bytes=states.offloaded_bytes)


def nvme_host_buffer_bytes(nvme_bytes: float, layers: int) -> float:
    """Host memory NVMe offload streams through (``offload_nvme``): two layers' share of what
    lives on NVMe, one being moved while the next is prefetched (ZeRO-Infinity's pinned
    buffers, Rajbhandari et al. 2021, Sec. 6.3)."""
    return 2.0 * nvme_bytes / max(layers, 1) if nvme_bytes else 0.0


def meta_bytes(meta: TensorMeta, precision: str) -> float:
    """Bytes of a tensor once float tensors are held in the training precision."""
    if meta.is_float:
        return meta.numel * PRECISION_BYTES[precision]
    return float(meta.nbytes)


def held_meta_bytes(name: str, meta: TensorMeta, precision: str,
                    sizes: Any = None) -> float:
    """Bytes of value ``name`` held in the dtype ``sizes`` gives it (bytes per element by
    name, ``cost.dtypes.HeldBytes``' maps), else in ``precision`` (``meta_bytes``)."""
    if sizes is not None and name in sizes:
        return meta.numel * sizes[name]
    return meta_bytes(meta, precision)


def sharding_for(graph: OpGraph, tp: int, sp: bool, sharding: Sharding | None) -> Sharding:
    """The given sharding, or Megatron-LM's for (tp, sp) (built once per graph)."""
    if sharding is not None:
        return sharding
    cache = graph.__dict__.setdefault("_autoplan_megatron", {})
    key = (tp, sp)
    if key not in cache:
        cache[key] = megatron_sharding(graph, tp, sp)
    return cache[key]


def _scale(p: Placement, t: int) -> float:
    return 1.0 / t if p.kind == "S" else 1.0


def shared_inputs(graph: OpGraph) -> frozenset[str]:
    """Activations made outside every layer and read by two layers or more (an attention mask,
    rotary tables): one tensor, however many layers keep it for backward. Cached."""
    cached = graph.__dict__.get("_autoplan_shared_inputs")
    if cached is not None:
        return cached
    layer_of: dict[int, int] = {}
    for b, block in enumerate(graph.blocks):
        for k, inst in enumerate(block.instances):
            for i in range(inst.start, inst.stop):
                layer_of[i] = (b, k)
    a = analyze(graph)
    readers: dict[str, set] = {}
    for i, op in enumerate(graph.ops):
        if i not in layer_of:
            continue
        for n in op.inputs:
            base = graph.value(graph.value(n).base)
            if base.kind == "activation" and a.producer.get(base.name, -1) not in layer_of:
                readers.setdefault(base.name, set()).add(layer_of[i])
    out = frozenset(n for n, layers in readers.items() if len(layers) > 1)
    graph.__dict__["_autoplan_shared_inputs"] = out
    return out


def activation_bytes(graph: OpGraph, start: int, stop: int, *, micro_batch_size: int,
                     tp: int = 1, sp: bool = False, recompute: str = "none",
                     precision: str = "bf16", sharding: Sharding | None = None,
                     context: Any = None, held: HeldBytes | None = None) -> float:
    """Bytes that ops[start:stop] keep for backward for one micro-batch, per device.

    ``sharding`` says where each tensor lies on the tp axis (default: Megatron-LM's for
    ``tp`` and ``sp``); a tensor split over the axis costs 1/t on each rank. ``context``: a
    context-parallel axis (``sharding.context_axis.ContextAxis``) splitting the sequence too.
    ``held``: the dtypes autocast holds them in (``cost.dtypes.held_bytes``; None: every
    float in ``precision``)."""
    return sum(activation_parts(graph, start, stop, micro_batch_size=micro_batch_size, tp=tp,
                                sp=sp, recompute=recompute, precision=precision,
                                sharding=sharding, context=context, held=held).values())


def activation_parts(graph: OpGraph, start: int, stop: int, *, micro_batch_size: int,
                     tp: int = 1, sp: bool = False, recompute: str = "none",
                     precision: str = "bf16", sharding: Sharding | None = None,
                     context: Any = None, held: HeldBytes | None = None) -> dict[str, float]:
    """``activation_bytes`` per kept tensor (by value; a kernel's internal tensors under
    their op's output name, summed)."""
    a = analyze(graph)
    sh = sharding_for(graph, tp, sp, sharding)
    t = sh.t
    batch_scale = micro_batch_size / graph.batch_size

    def scaled(name: str, meta: TensorMeta, placement: Placement, i: int = -1,
               sizes: Any = None) -> float:
        b = held_meta_bytes(name, meta, precision, sizes) * _scale(placement, t)
        if context is not None:
            b *= context.held_scale(i, name) if i >= 0 else context.value_scale(name)
        return b * batch_scale if name in a.batch_dependent else b

    if recompute in ("full", "ops"):
        # only the range's inputs stay: activations it reads that were produced before it
        # (and, op-level, what selective checkpointing stores: ``ops_kept``)
        inputs: dict[str, Placement] = {}
        for i in range(start, stop):
            for n in graph.ops[i].inputs:
                v = graph.value(n)
                # a view of a weight made inside the range (a transposed expert weight) is
                # not an activation: its base is the parameter
                if (v.kind == "activation" and graph.value(v.base).kind == "activation"
                        and a.producer.get(v.base, -1) < start):
                    inputs.setdefault(v.base, sh.value_placement.get(v.base, sh.input_placement(
                        graph, i, n)))
        own = own_sizes(held)
        out = {n: scaled(n, graph.value(n).meta, p, sizes=own)
               for n, p in sorted(inputs.items())}
        if recompute == "ops":
            for n, b in ops_kept(graph, start, stop, sh, scaled, own).items():
                out[n] = out.get(n, 0.0) + b
        return out
    if recompute not in ("none", "selective"):
        raise ConfigError(f"recompute must be one of none, selective, ops or full, got "
                          f"{recompute!r}")

    drop_vals = a.score_values if recompute == "selective" else frozenset()
    bases: set[str] = set()
    total: dict[str, float] = {}
    for i in range(start, stop):
        op = graph.ops[i]
        if recompute == "selective" and i in a.score_ops:
            continue
        copied = held.copies.get(i, frozenset()) if held is not None else frozenset()
        out = op.outputs[0] if op.outputs else ""
        for n in op.saved:
            v = graph.value(n)
            base = graph.value(v.base)
            if base.kind != "activation" or base.name in drop_vals:
                continue
            if base.name in copied:      # autocast's 16-bit copy, this op's own (cost.dtypes)
                where = (sh.input_placement(graph, i, n) if n in op.inputs
                         else sh.value_placement.get(n, REPLICATE))
                total[out] = total.get(out, 0.0) + scaled(
                    base.name, base.meta, where, i if n == base.name else -1,
                    sizes={base.name: held.lower_bytes})
                continue
            if base.name in bases:
                continue
            bases.add(base.name)
            where = (sh.input_placement(graph, i, n) if n in op.inputs
                     else sh.value_placement.get(n, REPLICATE))
            total[base.name] = total.get(base.name, 0.0) + scaled(
                base.name, base.meta, where, i if n == base.name else -1,
                sizes=held.kept if held is not None else None)
        if op.saved_internal:
            anchor, on_input = internal_anchor(graph, op)
            where = (sh.input_placement(graph, i, anchor) if on_input
                     else sh.value_placement.get(anchor, REPLICATE))
            for m in op.saved_internal:
                # under autocast a kernel keeps its statistics in their own dtype (fp32)
                own = {anchor: m.itemsize} if held is not None and m.is_float else None
                total[out] = total.get(out, 0.0) + scaled(anchor, m, where, i, sizes=own)
    return total


def ops_kept(graph: OpGraph, start: int, stop: int, sh: Sharding, scaled: Any,
             own: Any) -> dict[str, float]:
    """What the op-level policy stores of ops[start:stop] besides the range's inputs: every
    output of the ops whose kind it keeps (``oprules.OPS_POLICY_SAVES``: selective
    checkpointing caches an op's outputs whole), the kernel's internal outputs too (attention's
    log-sum-exp), in the dtype the op computes them in (``own``)."""
    out: dict[str, float] = {}
    for i in range(start, stop):
        op = graph.ops[i]
        if op.kind not in OPS_POLICY_SAVES or not op.outputs:
            continue
        for n in op.outputs:
            v = graph.value(n)
            if v.kind == "activation" and v.meta.is_float:
                out[n] = out.get(n, 0.0) + scaled(n, v.meta, sh.value_placement.get(
                    n, REPLICATE), i, sizes=own)
        if op.saved_internal:
            anchor, on_input = internal_anchor(graph, op)
            where = (sh.input_placement(graph, i, anchor) if on_input
                     else sh.value_placement.get(anchor, REPLICATE))
            for m in op.saved_internal:
                out[op.outputs[0]] = out.get(op.outputs[0], 0.0) + scaled(anchor, m, where, i)
    return out


def internal_anchor(graph: OpGraph, op: Any) -> tuple[str, bool]:
    """(value, whether it is an input) whose placement and batch share an op's internal
    tensors (``Op.saved_internal``) follow: its output's, but for a reduced output (a loss's
    scalar) its first input's (the softmax a cross entropy keeps is one per logit row)."""
    out = op.outputs[0] if op.outputs else ""
    if op.inputs and (not out or not graph.value(out).meta.shape):
        return op.inputs[0], True
    return out, False


def working_set_bytes(graph: OpGraph, start: int, stop: int, *, micro_batch_size: int,
                      precision: str = "bf16", sharding: Sharding | None = None,
                      tp: int = 1, sp: bool = False, context: Any = None,
                      held: HeldBytes | None = None) -> float:
    """Peak extra memory while one recomputed range runs its backward: all it keeps, at once."""
    return activation_bytes(graph, start, stop, micro_batch_size=micro_batch_size, tp=tp,
                            sp=sp, recompute="none", precision=precision, sharding=sharding,
                            context=context, held=held)
