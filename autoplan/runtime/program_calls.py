"""The calls a rank program makes (``program.build_program`` emits them as fx nodes): the
tensor-parallel collectives (``_c_*``) and the local kernels (``_k_*``), module-level so that
fx code can name them, with placements passed as text; and ``transition``, the nodes that move
a local tensor from one placement to another. Each reads its process group from the program's
``CommSlot`` at call time (``slot``), so one program is checked with shape-only stand-ins and
then run with the real groups.

The local kernel a strategy names (``OpStrategy.kernel``, declared in the sharding layer's
``registry.KERNELS``) is registered here under the same name (``register_kernel``): the call
``(target, args, kwargs, slot, *extra)`` the program emits for it. ``tests/test_rule_registry.py``
fails where a strategy names a kernel nobody registered, or a kernel is registered for no
strategy."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from torch import fx

from autoplan.errors import PlanError
from autoplan.graph.opgraph import Op, OpGraph
from autoplan.runtime import experts, float8, kernels, ring_attention, tp_comm
from autoplan.sharding.placement import Placement
from autoplan.sharding.strategy import OpStrategy


# ---- the kernel registry ------------------------------------------------------------------------

def _no_extra(graph: OpGraph, op: Op, s: OpStrategy) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class KernelCall:
    """How the program calls one named kernel: ``fn(target, args, kwargs, slot, *extra)``
    (module-level, so fx code names it), ``extra(graph, op, strategy)`` the text arguments it
    takes beside them, and ``returns_bias``: it returns ``(output, bias)``, the bias added
    after the output's collective (``bias_after_reduce``)."""

    fn: Callable
    extra: Callable[[OpGraph, Op, OpStrategy], tuple[str, ...]] = _no_extra
    returns_bias: bool = False


_CALLS: dict[str, KernelCall] = {}
KERNEL_CALLS: Mapping[str, KernelCall] = MappingProxyType(_CALLS)


def register_kernel(name: str, *, extra: Callable[[OpGraph, Op, OpStrategy], tuple[str, ...]]
                    = _no_extra, returns_bias: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated call as the runtime of the kernel strategies name ``name``."""
    def deco(fn: Callable) -> Callable:
        if name in _CALLS:
            raise ValueError(f"kernel {name!r} is registered twice")
        _CALLS[name] = KernelCall(fn, extra, returns_bias)
        return fn
    return deco


def _input_placement(graph: OpGraph, op: Op, s: OpStrategy) -> tuple[str, ...]:
    """The placement the product's activation arrives in (``sp_linear`` gathers it)."""
    k = next(k for k, n in enumerate(op.inputs)
             if graph.value(n).kind in ("activation", "input"))
    return (str(s.inputs[k]),)


def _gathered_placement(graph: OpGraph, op: Op, s: OpStrategy) -> tuple[str, ...]:
    """The placement the weight is stored in (``gathered_weight`` gathers it)."""
    return (str(s.inputs[s.gathered_inputs()[0]]),)


# ---- calls the program makes (module-level so fx code can name them; placements as text) -----

@functools.lru_cache(maxsize=None)
def _p(text: str) -> Placement:
    return Placement.parse(text)


def call_gather(x, slot, p):
    return tp_comm.gather(x, slot.comm, _p(p))


def call_gather_sp(x, slot, p):
    return tp_comm.gather_sp(x, slot.comm, _p(p))


def call_scatter(x, slot, p):
    return tp_comm.scatter(x, slot.comm, _p(p))


def call_reduce(x, slot):
    return tp_comm.reduce(x, slot.comm)


def call_reduce_scatter(x, slot, p):
    return tp_comm.reduce_scatter(x, slot.comm, _p(p))


def call_reduce_grad(x, slot):
    return tp_comm.reduce_grad(x, slot.comm)


def call_reshard(x, slot, src, dst):
    return tp_comm.reshard(x, slot.comm, _p(src), _p(dst))


@register_kernel("vocab_embedding")
def kernel_vocab_embedding(target, args, kwargs, slot):
    return kernels.vocab_embedding(target, args, kwargs, slot.comm)


@register_kernel("vocab_cross_entropy")
def kernel_vocab_cross_entropy(target, args, kwargs, slot):
    return kernels.vocab_cross_entropy(target, args, kwargs, slot.comm)


@register_kernel("split_loss")
def kernel_split_loss(target, args, kwargs, slot):
    return kernels.split_loss(target, args, kwargs, slot.comm)


@register_kernel("sync_batch_norm")
def kernel_sync_batch_norm(target, args, kwargs, slot):
    """Batch norm split over the batch on the tp axis: statistics over tp (and dp)."""
    group = slot.dp_tp if slot.dp_tp is not None else slot.comm
    return kernels.batch_norm_over(group)(target, args, kwargs, slot.comm)


def kernel_dp_batch_norm(target, args, kwargs, slot):
    """Batch norm whose batch is split over data-parallel ranks only: statistics over dp."""
    if slot.dp is None:
        return target(*args, **kwargs)
    return kernels.batch_norm_over(slot.dp)(target, args, kwargs, slot.comm)


def kernel_dispatch(x, offs, local_experts, slot):
    if slot.ep is None:
        raise PlanError("an expert-parallel grouped product ran without its expert-parallel "
                        "group: connect() the program first")
    return experts.dispatch(x, offs, local_experts, slot.ep)


def kernel_dispatch_stacked(x, slot):
    if slot.ep is None:
        raise PlanError("an expert-parallel stacked product ran without its expert-parallel "
                        "group: connect() the program first")
    return experts.dispatch_stacked(x, slot.ep)


def kernel_local_experts(target, args, kwargs, d, dtype=None):
    return experts.local_experts(target, args, kwargs, d, dtype)


def kernel_grouped_product(target, args, kwargs, dtype=None):
    return experts.grouped_product(target, args, kwargs, dtype)


def kernel_norm(target, args, kwargs):
    return kernels.norm_in_input_dtype(target, list(args), dict(kwargs))


def kernel_float8_linear(target, args, kwargs, recipe):
    """``aten.linear`` run as torchao's ``Float8Linear`` runs it under ``recipe``."""
    x, w, *rest = args
    return float8.float8_linear(x, w, rest[0] if rest else kwargs.get("bias"), recipe)


def kernel_combine(y, d):
    return experts.combine(y, d)


@register_kernel("mean_partial")
def kernel_mean_partial(target, args, kwargs, slot):
    return kernels.mean_partial(target, args, kwargs, slot.comm)


@register_kernel("sp_linear", extra=_input_placement)
def kernel_sp_linear(target, args, kwargs, slot, p):
    return kernels.sp_linear(target, args, kwargs, slot.comm, _p(p))


@register_kernel("gathered_weight", extra=_gathered_placement)
def kernel_gathered_weight(target, args, kwargs, slot, p):
    return kernels.gathered_weight(target, args, kwargs, slot.comm, _p(p))


@register_kernel("bias_after_reduce", returns_bias=True)
def kernel_without_bias(target, args, kwargs, slot):
    return kernels.without_bias(target, args, kwargs)


def kernel_add_bias(y, bias, target):
    return kernels.add_bias(y, bias, target)


def kernel_split_random(target, args, kwargs, slot):
    return kernels.split_random(target, args, kwargs, slot.comm)


@register_kernel("ring_attention")
def kernel_ring_attention(target, args, kwargs, slot):
    return ring_attention.ring_attention(target, args, kwargs, slot.comm)


def kernel_split_random_axes(target, args, kwargs, *slots):
    """A random op on a tensor split over several axes (``slots``: theirs, outer first; None
    where the tensor is whole on it): a mask per piece, the seed offset by the piece's index
    over the axes that split it."""
    comms = [s.comm for s in slots if s is not None and s.comm is not None]
    if not comms or any(isinstance(c, tp_comm.ShapeComm) for c in comms):
        return target(*args, **kwargs)
    rank = 0
    for c in comms:
        rank = rank * c.size + c.rank
    return kernels.split_random(target, args, kwargs, tp_comm.Ranked(rank))


class _TpKernel:
    """An op whose call runs a tp-axis kernel: what a cp-axis kernel calls as its op (it reads
    the op's schema for its arguments)."""

    def __init__(self, op, kernel: str, slot):
        self._op, self._kernel, self._slot = op, kernel, slot
        self._schema = op._schema
        self.tags = getattr(op, "tags", ())

    def __call__(self, *args, **kwargs):
        return KERNEL_CALLS[self._kernel].fn(self._op, list(args), dict(kwargs), self._slot)


def kernel_composed(target, args, kwargs, outer_slot, outer, inner_slot, inner):
    """An op both axes run a kernel for (``context_axis.COMPOSED``): one split loss over both
    groups, or the cp kernel around the tp one."""
    if outer == inner == "split_loss":
        return kernels.split_loss(target, args, kwargs,
                                  tp_comm.Chain(outer_slot.comm, inner_slot.comm))
    return KERNEL_CALLS[outer].fn(_TpKernel(target, inner, inner_slot), args, kwargs,
                                  outer_slot)


def kernel_grad_scale(x, factor):
    """``x`` itself; its gradient times ``factor`` (a weight whose gradient is whole on every
    context-parallel rank: the dp x cp average would count it ``cp`` times)."""
    return kernels.grad_scale(x, factor)


def transition(g: fx.Graph, x: fx.Node, src: Placement, dst: Placement, slot: fx.Node
               ) -> fx.Node:
    """Nodes that move a local tensor from ``src`` to ``dst`` (values are never partial)."""
    if src == dst:
        return x
    if src.kind == "R" and dst.kind == "S":
        return g.call_function(call_scatter, (x, slot, str(dst)))
    if src.kind == "S" and dst.kind == "R":
        return g.call_function(call_gather, (x, slot, str(src)))
    if src.kind == "S" and dst.kind == "S":
        return g.call_function(call_reshard, (x, slot, str(src), str(dst)))
    if src.kind == "P" and dst.kind == "R":
        return g.call_function(call_reduce, (x, slot))
    if src.kind == "P" and dst.kind == "S":
        return g.call_function(call_reduce_scatter, (x, slot, str(dst)))
    raise PlanError(f"no collective turns {src} into {dst}")
