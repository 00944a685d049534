"""The rank program: the traced graph, rewritten op by op to run the plan on local tensors.

The planner chose one strategy per op of the traced graph; the runtime runs exactly that graph
with exactly those strategies, whatever modules and functional code produced it (HF ``Conv1D``,
raw parameters, ``nn.MultiheadAttention``, routers, experts). For one rank of a ``t``-way
tensor-parallel axis, ``build_program``:

1. exports the model (with its loss) at the micro-batch shape (``torch.export``) and maps the
   plan's strategies onto its ops by position (the planning graph has the same ops in the same
   order; a mismatch is refused);
2. shards every parameter and buffer to the placement its first reader needs, and puts the
   local shard back on the user's module (so the user's model holds this rank's weights);
3. copies the graph node by node: each input moved from where its producer left it to where
   the op needs it, the input-side collective of the strategy, the op itself (or its local
   kernel) with shape arguments rewritten to local sizes (``view(b, s, 16, 64)`` becomes
   ``view(b, s, 8, 64)`` on 2 ranks), and the output-side collective (``tp_comm``);
4. checks the result on fake tensors: every op's local output must have the shape its
   placement says, else the plan is refused before any collective runs.

With context parallelism on its own axis (``ParallelConfig.cp``) every op also takes its
strategy on that axis (``sharding/context_axis.py``), applied outside the tp one: an input is
moved on the cp axis, then on tp; the op computes on the piece both leave it; its outputs are
reduced or gathered on tp, then on cp. A weight read by an op not split over cp has its
gradient scaled by ``1 / cp`` on the way back (the dp x cp average would count it cp times).

The collectives read their process group from ``program.comm_slot`` at call time, so the same
program is checked with ``ShapeComm`` and then run with the real group.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autoplan.errors import PlanError
from autoplan.graph.opgraph import Op, OpGraph
from autoplan.graph.trace import TRANSPARENT
from autoplan.graph.experts import GROUPED_MM, find_experts
from autoplan.runtime import tp_comm
from autoplan.runtime.program_calls import (KERNEL_CALLS, call_gather, call_gather_sp, call_reduce,
                                            call_reduce_grad, call_reduce_scatter,
                                            kernel_add_bias, kernel_combine, kernel_composed, kernel_dispatch,
                                            kernel_dispatch_stacked, kernel_dp_batch_norm,
                                            kernel_grad_scale,
                                            kernel_grouped_product, kernel_local_experts, kernel_norm,
                                            kernel_split_random, kernel_split_random_axes, transition)
from autoplan.sharding.context_axis import ContextAxis
from autoplan.sharding.expert_regions import expert_regions
from autoplan.sharding.placement import REPLICATE, Placement, local_shape
from autoplan.sharding.sharding import Sharding, mutates_input
from autoplan.sharding.strategy import OpStrategy, input_action, opname, output_action

SHAPE_ARG = {"view": 1, "_unsafe_view": 1, "reshape": 1, "expand": 1}
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}
_SEEDED = torch.Tag.nondeterministic_seeded     # random ops: dropout, attention's dropout
# norms whose weights may arrive in another dtype than their input (``kernels``)
_NORMS = frozenset({"layer_norm", "native_layer_norm", "group_norm", "native_group_norm",
                    "rms_norm"})


@dataclass
class CommSlot:
    """Where the program's collectives find their groups (swapped for shape checks): the
    tensor-parallel axis, and for batch norm's statistics the data-parallel group (``dp``) and
    the data x tensor-parallel group (``dp_tp``, when batch norm also splits the batch over
    the tensor-parallel axis), and the expert-parallel group of a grouped product's all-to-all
    exchanges (``ep``). None where the group has one rank."""

    comm: Any
    dp: Any = None
    dp_tp: Any = None
    ep: Any = None              # the expert-parallel group (``ep_size`` > 1)
    ep_size: int = 1
    size: int = 1               # the axis's ranks (the cp slot's: shape checks stand in)


@dataclass
class Program:
    graph_module: fx.GraphModule
    comm_slot: CommSlot
    step_params: list[str]                  # FQNs whose gradients are all-reduced per step
    state: dict[str, Placement]             # FQN -> stored placement on the axis
    cp_slot: CommSlot | None = None         # the context-parallel axis (cp > 1)


OP = "autoplan_op"          # node.meta key: the index of the graph op a node belongs to
SHAPE = "autoplan_shape"    # node.meta key: the local shape the op's placement gives
VAL = "autoplan_val"        # node.meta key: (shape, dtype, requires_grad) seen by the check


# ---- argument walking (the order trace.py reads tensor inputs in) ------------------------------

def _map_tensors(args: Any, kwargs: dict, fn: Callable[[fx.Node], Any]) -> tuple[Any, dict]:
    def walk(a):
        if isinstance(a, fx.Node):
            return fn(a)
        if isinstance(a, (list, tuple)):
            return type(a)(walk(x) for x in a)
        return a
    new_args = walk(list(args))
    new_kwargs = {k: walk(v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def _map_devices(a: Any, device: torch.device) -> Any:
    if isinstance(a, torch.device):
        return device
    if isinstance(a, (list, tuple)):
        return type(a)(_map_devices(x, device) for x in a)
    if isinstance(a, dict):
        return {k: _map_devices(v, device) for k, v in a.items()}
    return a


# ---- the builder ---------------------------------------------------------------------------------

class _Builder:
    def __init__(self, ep: Any, graph: OpGraph, sh: Sharding, *, prefix: str, t: int,
                 device: torch.device, state_tensor: Callable[[str, str, Placement], Any],
                 ep_size: int = 1, cp: ContextAxis | None = None):
        self.ep, self.eg, self.sh, self.prefix, self.t = ep, graph, sh, prefix, t
        self.cp = cp
        if cp is not None and ep_size > 1:
            raise PlanError("a plan with both context (cp) and expert (ep) parallelism cannot "
                            "run; re-plan with one of them")
        self.ep_size = ep_size
        self.experts = find_experts(graph) if ep_size > 1 else None
        if ep_size > 1 and self.experts is None:
            raise PlanError(f"the plan splits experts over ep={ep_size} ranks, but the model "
                            "has no product of stacked expert weights (grouped_mm, or bmm / "
                            "einsum over an experts dim) to split; re-plan with ep=1")
        # expert parallelism: values held as dispatched rows, their exchanges' states, and
        # the dispatches made (one per value and placement)
        self.regions = expert_regions(graph, sh) if self.experts is not None else None
        self.held: dict[str, fx.Node] = {}
        self.held_state: dict[str, fx.Node] = {}
        self.dispatched: dict[tuple[str, str], tuple[fx.Node, fx.Node]] = {}
        self.stacked_held: set[str] = set()
        self.device = device
        self.state_tensor = state_tensor
        self.g = fx.Graph()
        self.env: dict[str, fx.Node] = {}          # value name -> local node
        self.alias: dict[str, str] = {}            # transparent node -> its value
        self.last_op = 0
        self.attrs: dict[str, Any] = {}
        self.step_params: set[str] = set()
        self.slot = CommSlot(comm=None, ep_size=ep_size)
        self.attrs["_autoplan_comm"] = self.slot
        self.slot_node = self.g.get_attr("_autoplan_comm")
        self.cp_slot = self.cp_node = None
        if cp is not None:
            self.cp_slot = CommSlot(comm=None, size=cp.c)
            self.attrs["_autoplan_cp_comm"] = self.cp_slot
            self.cp_node = self.g.get_attr("_autoplan_cp_comm")
            self.whole_readers = cp.whole_weight_readers()

    # -- helpers --
    def fqn(self, target: str) -> str:
        return target[len(self.prefix):] if self.prefix and target.startswith(self.prefix) \
            else target

    def placement(self, name: str) -> Placement:
        return self.sh.placement_of(self.eg, name)

    def emit(self, fn, args, i: int) -> fx.Node:
        n = self.g.call_function(fn, tuple(args))
        n.meta[OP] = i
        return n

    # -- nodes --
    def build(self) -> fx.Graph:
        from torch.export.graph_signature import InputKind
        specs = {s.arg.name: s for s in self.ep.graph_signature.input_specs
                 if hasattr(s.arg, "name")}
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                spec = specs.get(node.name)
                kind = spec.kind if spec is not None else None
                if kind in (InputKind.PARAMETER, InputKind.BUFFER):
                    self._state(node, self.fqn(spec.target), "param" if kind ==
                                InputKind.PARAMETER else "buffer")
                elif kind == InputKind.CONSTANT_TENSOR:
                    key = f"_autoplan_const_{len(self.attrs)}"
                    self.attrs[key] = self.ep.constants[spec.target]
                    self.env[node.name] = self.g.get_attr(key)
                elif kind == InputKind.USER_INPUT:
                    self.env[node.name] = self.g.placeholder(node.name)
                else:
                    raise PlanError(f"the exported program has an input of kind {kind} "
                                    f"({node.name}) that autoplan cannot run")
            elif node.op == "get_attr":
                key = f"_autoplan_attr_{node.target}"
                self.attrs[key] = _without_dtype_asserts(_attr(self.ep.graph_module,
                                                               node.target))
                self.env[node.name] = self.g.get_attr(key)
            elif node.op == "call_function":
                if node.target is operator.getitem:
                    continue
                if node.target in TRANSPARENT and node.name not in self.eg._op_index:
                    # no op of the graph: the same value, its layout made contiguous again
                    vn = self.alias.get(node.args[0].name, node.args[0].name)
                    self.alias[node.name] = vn
                    x = self.g.call_function(node.target, (self.env[vn],)
                                             + tuple(node.args[1:]), node.kwargs)
                    x.meta[OP] = self.last_op          # it runs with the op before it
                    self.env[vn] = x
                    continue
                self._call(node)
            elif node.op == "output":
                self._output(node)
        return self.g

    def _state(self, node: fx.Node, fqn: str, kind: str) -> None:
        p = self.placement(node.name)
        self.attrs[fqn] = self.state_tensor(fqn, kind, p)
        self.env[node.name] = self.g.get_attr(fqn)

    def _call(self, node: fx.Node) -> None:
        i = self.eg.op_index(node.name)
        self.last_op = i
        op = self.eg.ops[i]
        s = self.sh.op_strategy[i]
        if not op.outputs:
            if "assert" in opname(op) or "constrain" in opname(op):
                return          # metadata checks on the global shapes: not for local tensors
        c = self.cp.strategy(i) if self.cp is not None else None
        if c is not None:
            why = self.cp.tp_conflict(i, s, self.t)
            if why:
                raise PlanError(f"op {op.name} ({op.target}): its tp strategy {s.name} does "
                                f"not run under context parallelism over cp={self.cp.c} "
                                f"({why}); re-plan")
        region = self.regions is not None and i in self.regions.members
        expert_op = region and i in self.experts.ops
        to_dispatch = {x for j, x in self.regions.dispatch if j == i} if region else set()
        swapped = {}
        if region:              # dispatched inputs are read as the rows the experts hold
            for k, vn in enumerate(op.inputs):
                if vn in self.held and not (expert_op and k == 0 and vn in to_dispatch):
                    swapped[vn] = self.env[vn]
                    self.env[vn] = self.held[vn]
        inputs = self._inputs(node, op, s, i)
        state = None
        if expert_op:
            x = op.inputs[0]
            if x in to_dispatch:
                key = (x, str(s.inputs[0]))
                if key not in self.dispatched and i in self.experts.stacked:
                    pair = self.emit(kernel_dispatch_stacked, (inputs[0], self.slot_node), i)
                    self.dispatched[key] = (self.emit(operator.getitem, (pair, 0), i),
                                            self.emit(operator.getitem, (pair, 1), i))
                elif key not in self.dispatched:
                    pair = self.emit(kernel_dispatch, (inputs[0], inputs[2], self.experts.num_experts
                                                   // self.ep_size, self.slot_node), i)
                    self.dispatched[key] = (self.emit(operator.getitem, (pair, 0), i),
                                            self.emit(operator.getitem, (pair, 1), i))
                inputs[0], state = self.dispatched[key]
            else:
                state = self.held_state[x]
        elif region:
            state = next(self.held_state[vn] for vn in op.inputs if vn in self.held_state)
        # stacked rows are held as (experts / ep, ep * rows, ...): every peer's rows of this
        # rank's experts
        stacked = region and (i in self.experts.stacked if expert_op else
                              any(vn in self.stacked_held for vn in op.inputs))
        it = iter(inputs)

        def take(a: fx.Node):
            name = self.alias.get(a.name, a.name)
            if name in self.env and name in self.eg._values_by_name:
                return next(it)
            return self.env.get(name, a)
        args, kwargs = _map_tensors(node.args, dict(node.kwargs), take)
        args = _map_devices(args, self.device)
        kwargs = _map_devices(kwargs, self.device)
        local_outs = [self._local_out(n, k, s, c) for k, n in enumerate(op.outputs)]
        if any(shape is None for shape in local_outs):
            raise PlanError(f"op {op.name} ({op.target}): strategy {s.name} splits an output "
                            "unevenly; re-plan")
        if self.experts is not None:        # expert weights' views: this rank's experts only
            local_outs = [(shape[0] // self.ep_size,) + tuple(shape[1:])
                          if n in self.experts.chain else shape
                          for shape, n in zip(local_outs, op.outputs)]
        args = _local_shape_args(op, self.eg, args, local_outs)
        bias_node = None
        if c is not None and c.kernel:            # the cp axis's kernel (around tp's own)
            if s.kernel:
                out = self.emit(kernel_composed, (node.target, args, kwargs, self.cp_node,
                                              c.kernel, self.slot_node, s.kernel), i)
            else:
                call = KERNEL_CALLS[c.kernel]
                if call.returns_bias:
                    raise PlanError(f"op {op.name} ({op.target}): kernel {c.kernel} does not "
                                    "run on the context-parallel axis; re-plan")
                out = self.emit(call.fn, (node.target, args, kwargs, self.cp_node,
                                          *call.extra(self.eg, op, c)), i)
        elif s.kernel:                             # the strategy's local kernel
            call = KERNEL_CALLS[s.kernel]
            out = self.emit(call.fn, (node.target, args, kwargs, self.slot_node,
                                      *call.extra(self.eg, op, s)), i)
            if call.returns_bias:               # (output without bias, bias): added below
                pair = out
                out = self.emit(operator.getitem, (pair, 0), i)
                bias_node = self.emit(operator.getitem, (pair, 1), i)
        elif expert_op:
            out = self.emit(kernel_local_experts, (node.target, args, kwargs, state), i)
        elif opname(op) in GROUPED_MM:
            out = self.emit(kernel_grouped_product, (node.target, args, kwargs), i)
        elif c is not None and _SEEDED in getattr(node.target, "tags", ()) \
                and any(p.kind == "S" for p in c.inputs + s.inputs):
            # a mask per piece over both axes (``kernels.split_random``)
            split = [node_ if any(p.kind == "S" for p in st.inputs) else None
                     for st, node_ in ((c, self.cp_node), (s, self.slot_node))]
            out = self.emit(kernel_split_random_axes, (node.target, args, kwargs, *split), i)
        elif self.t > 1 and _SEEDED in getattr(node.target, "tags", ()) \
                and any(p.kind == "S" for p in s.inputs):
            # dropout of a split tensor: a mask per rank (``kernels.split_random``)
            out = self.emit(kernel_split_random, (node.target, args, kwargs, self.slot_node), i)
        elif opname(op) == "batch_norm":
            out = self.emit(kernel_dp_batch_norm, (node.target, args, kwargs, self.slot_node), i)
        elif opname(op) in _NORMS:
            out = self.emit(kernel_norm, (node.target, args, kwargs), i)
        else:
            target = node.target
            if target in _VIEWS:
                # a view the trace could take may need a copy here: a split of a transposed
                # tensor is not contiguous where the whole one is, and a kernel may lay its
                # output out otherwise at run time than when traced (CPU SDPA in bf16 under
                # autocast against its fake kernel): reshape views when it can, copies when
                # it must
                target = torch.ops.aten.reshape.default
            out = self.g.call_function(target, tuple(args), kwargs)
            out.meta[OP] = i
        for k, vn in enumerate(op.outputs):
            y = out if len(op.outputs) == 1 and not _multi(node) else \
                self.emit(operator.getitem, (out, _out_index(node, vn)), i)
            y.meta[SHAPE] = local_outs[k] if not stacked else (
                local_outs[k][0] // self.ep_size, local_outs[k][1] * self.ep_size,
                *local_outs[k][2:])
            y = self._output_action(output_action(self.eg, op, s, k), y, s, k,
                                    self.slot_node, i)
            if bias_node is not None and k == 0:
                y = self.emit(kernel_add_bias, (y, bias_node, node.target), i)
            if c is not None:                   # then on the cp axis
                y = self._output_action(output_action(self.eg, op, c, k), y, c, k,
                                        self.cp_node, i)
            self.env[vn] = y
            if region:          # held dispatched; brought home where read from outside
                self.held[vn], self.held_state[vn] = y, state
                if stacked:
                    self.stacked_held.add(vn)
                if vn in self.regions.combine:
                    self.env[vn] = self.emit(kernel_combine, (y, state), i)
        self.env.update(swapped)

    def _local_out(self, n: str, k: int, s: OpStrategy, c: OpStrategy | None
                   ) -> tuple[int, ...] | None:
        """This rank's shape of output ``n`` (``k``-th) as the op computes it: its cp piece
        (when there is a cp axis), then its tp piece of that."""
        shape = self.eg.value(n).meta.shape
        if c is not None:
            shape = local_shape(shape, c.local_output(k), self.cp.c)
            if shape is None:
                return None
        return local_shape(shape, s.local_output(k), self.t)

    def _output_action(self, action: str, y: fx.Node, st: OpStrategy, k: int, slot: fx.Node,
                       i: int) -> fx.Node:
        if action == "reduce":
            return self.emit(call_reduce, (y, slot), i)
        if action == "reduce_scatter":
            return self.emit(call_reduce_scatter, (y, slot, str(st.outputs[k])), i)
        if action == "gather":
            return self.emit(call_gather, (y, slot, str(st.local_output(k))), i)
        return y

    def _move(self, x: fx.Node, op: Op, k: int, vn: str, src: Placement, want: Placement,
              slot: fx.Node, i: int) -> fx.Node:
        """Input ``k`` moved from where its producer left it to where the op takes it."""
        if src == want:
            return x
        if mutates_input(op.target) and k == 0:
            raise PlanError(f"op {op.name} ({op.target}) writes its input {vn} in place, but "
                            f"the plan moves that input from {src} to {want} first (the write "
                            "would land on a copy); re-plan")
        x = transition(self.g, x, src, want, slot)
        x.meta[OP] = i
        return x

    def _cp_input(self, x: fx.Node, op: Op, k: int, i: int) -> fx.Node:
        """The cp axis's own action on input ``k`` (after tp's): a gather, the gradient's
        reduction, or a whole weight gradient's ``1 / cp``. A weight read by an op split over
        cp needs nothing: its gradient is this rank's part, summed by the dp x cp average."""
        c = self.cp.strategy(i)
        if self.eg.value(op.inputs[k]).kind == "param":
            if (i, k) in self.whole_readers:
                return self.emit(kernel_grad_scale, (x, 1.0 / self.cp.c), i)
            return x
        action = input_action(self.eg, op, c, k)
        if action == "gather":
            return self.emit(call_gather, (x, self.cp_node, str(c.inputs[k])), i)
        if action == "gather_sp":
            return self.emit(call_gather_sp, (x, self.cp_node, str(c.inputs[k])), i)
        if action == "reduce_grad":
            return self.emit(call_reduce_grad, (x, self.cp_node), i)
        return x

    def _inputs(self, node: fx.Node, op: Op, s: OpStrategy, i: int) -> list[fx.Node]:
        out = []
        bwd_params = {c.value for c in s.comms if c.phase == "bwd" and c.kind == "all_reduce"}
        for k, vn in enumerate(op.inputs):
            v = self.eg.value(vn)
            x = self.env[vn]
            if self.cp is not None:             # on the cp axis first (the outer one)
                x = self._move(x, op, k, vn, self.cp.placement(vn),
                               self.cp.strategy(i).inputs[k], self.cp_node, i)
            want = s.inputs[k]
            x = self._move(x, op, k, vn, self.placement(vn), want, self.slot_node, i)
            action = input_action(self.eg, op, s, k)
            if action == "step" and vn in bwd_params:
                action = "reduce_grad"          # a weight with mixed partial/whole gradients
            if s.kernel in ("sp_linear", "gathered_weight") and action in ("gather",
                                                                            "gather_sp"):
                action = ""                     # the kernel gathers (twice) itself
            if action == "gather":
                x = self.emit(call_gather, (x, self.slot_node, str(want)), i)
            elif action == "gather_sp":
                x = self.emit(call_gather_sp, (x, self.slot_node, str(want)), i)
            elif action == "reduce_grad":
                x = self.emit(call_reduce_grad, (x, self.slot_node), i)
            elif action == "step":
                self.step_params.add(v.fqn)
            if self.cp is not None:
                x = self._cp_input(x, op, k, i)
            out.append(x)
        return out

    def _output(self, node: fx.Node) -> None:
        def whole(a: fx.Node):
            vn = self.alias.get(a.name, a.name)
            if vn not in self.env:
                return self.env.get(vn, a)
            x = transition(self.g, self.env[vn], self.placement(vn), REPLICATE,
                           self.slot_node)
            if self.cp is not None:          # tp's pieces first, then cp's
                x = transition(self.g, x, self.cp.placement(vn), REPLICATE, self.cp_node)
            return x
        args, _ = _map_tensors(node.args, {}, whole)
        outs = args[0]
        if isinstance(outs, (list, tuple)) and len(outs) == 1:
            outs = outs[0]
        self.g.output(outs)


def _attr(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _without_dtype_asserts(obj: Any) -> Any:
    """A higher-order op's body (an autocast-disabled region, a ``no_grad`` block) without the
    dtype asserts export writes before each ``.to()``: they state the dtypes of one trace,
    which the step can change (autocast, FSDP's 16-bit weights), as the top level's are
    dropped too. A copy: the exported program keeps its own."""
    if not isinstance(obj, fx.GraphModule):
        return obj
    asserts = [n for n in obj.graph.nodes if n.op == "call_function"
               and n.target is torch.ops.aten._assert_tensor_metadata.default]
    nested = [n for n in obj.graph.nodes if n.op == "get_attr"
              and isinstance(_attr(obj, n.target), fx.GraphModule)]
    if not asserts and not nested:
        return obj
    graph = fx.Graph()
    graph.output(graph.graph_copy(obj.graph, {}))
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default:
            graph.erase_node(n)
    root = {n.target: _without_dtype_asserts(_attr(obj, n.target))
            for n in graph.nodes if n.op == "get_attr"}
    return fx.GraphModule(root, graph, class_name=type(obj).__name__)


def _multi(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _out_index(node: fx.Node, value_name: str) -> int:
    for u in node.users:
        if u.target is operator.getitem and u.name == value_name:
            return int(u.args[1])
    raise PlanError(f"op {node.name}: no output {value_name}")


def _local_shape_args(op: Op, graph: OpGraph, args: list, local_outs: list) -> list:
    """Shape arguments written with global sizes, rewritten to this rank's sizes."""
    name = opname(op)
    glob = [graph.value(n).meta.shape for n in op.outputs]
    if all(tuple(a) == tuple(b) for a, b in zip(glob, local_outs)):
        return args
    args = list(args)
    if name in SHAPE_ARG:
        args[SHAPE_ARG[name]] = list(local_outs[0])
        return args
    x = graph.value(op.inputs[0]).meta.shape
    if name == "split":
        axis = (args[2] if len(args) > 2 else 0) % len(x)
        args[1] = local_outs[0][axis]
    elif name == "split_with_sizes":
        axis = (args[2] if len(args) > 2 else 0) % len(x)
        args[1] = [o[axis] for o in local_outs]
    elif name == "unflatten":
        axis = args[1] % len(x)
        args[2] = list(local_outs[0][axis:axis + len(args[2])])
    return args


# ---- entry point -----------------------------------------------------------------------------

def build_program(ep: Any, graph: OpGraph, sharding: Sharding, *, prefix: str, t: int,
                  device: torch.device,
                  state_tensor: Callable[[str, str, Placement], Any],
                  ep_size: int = 1, cp: ContextAxis | None = None) -> Program:
    """The rank program of ``sharding`` over ``graph`` (an OpGraph of ``ep``). ``state_tensor``
    (fqn, "param"|"buffer", placement) returns this rank's local tensor of a parameter or
    buffer (already sharded, expert weights to this rank's experts). ``ep_size`` > 1: the
    grouped products run expert-parallel (``runtime/experts.py``). ``cp``: the sequence split
    over a context-parallel axis of its own as well."""
    b = _Builder(ep, graph, sharding, prefix=prefix, t=t, device=device,
                 state_tensor=state_tensor, ep_size=ep_size, cp=cp)
    g = b.build()
    gm = fx.GraphModule(b.attrs, g, class_name="RankProgram")
    return Program(graph_module=gm, comm_slot=b.slot, step_params=sorted(b.step_params),
                   state=dict(sharding.state), cp_slot=b.cp_slot)


def check_shapes(program: Program, example_inputs: tuple, t: int,
                 device: torch.device | None = None,
                 autocast_dtype: torch.dtype | None = None) -> None:
    """Run the program on fake tensors with shape-only collectives: every op must produce the
    local shape its placement says (else PlanError naming the op). Each node keeps what it
    produced (``node.meta[VAL]``: pipeline stages declare their inputs and outputs with it),
    under the step's autocast (``autocast_dtype``) so the dtypes are the step's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    gm = program.graph_module
    device = device or next((x.device for x in example_inputs
                             if isinstance(x, torch.Tensor) and not x.is_meta),
                            torch.device("cpu"))
    real, real_ep = program.comm_slot.comm, program.comm_slot.ep
    program.comm_slot.comm = tp_comm.ShapeComm(size=t)
    if program.comm_slot.ep_size > 1:
        program.comm_slot.ep = tp_comm.ShapeComm(size=program.comm_slot.ep_size)
    cp = program.cp_slot
    real_cp = cp.comm if cp is not None else None
    if cp is not None:
        cp.comm = tp_comm.ShapeComm(size=cp.size)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    amp = (torch.autocast(device.type, dtype=autocast_dtype)
           if autocast_dtype is not None and device.type != "meta" else contextlib.nullcontext())

    class Check(fx.Interpreter):
        def fetch_attr(self, target):
            obj = super().fetch_attr(target)
            if not isinstance(obj, torch.Tensor):
                return obj
            if obj.is_meta and device.type != "meta":
                # another pipeline rank's weight: its shape and dtype, on this rank's device
                return torch.empty(obj.shape, dtype=obj.dtype, device=device,
                                   requires_grad=obj.requires_grad)
            # a fake copy: in-place ops (batch norm's counters) must not touch the real one
            return mode.from_tensor(obj)

        def run_node(self, n):
            try:
                out = super().run_node(n)
            except PlanError:
                raise
            except Exception as e:
                raise PlanError(f"the rank program fails at {n.format_node()}: "
                                f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from e
            if isinstance(out, torch.Tensor):
                n.meta[VAL] = (tuple(out.shape), out.dtype, out.requires_grad)
            want = n.meta.get(SHAPE)
            if want is not None and isinstance(out, torch.Tensor) and tuple(out.shape) != want:
                raise PlanError(f"the rank program computes shape {tuple(out.shape)} at "
                                f"{n.format_node()}, the plan says {want}")
            return out
    try:
        with mode, amp:
            fake = [(torch.empty(x.shape, dtype=x.dtype, device=device) if x.is_meta
                     else mode.from_tensor(x)) if isinstance(x, torch.Tensor) else x
                    for x in example_inputs]
            Check(gm).run(*fake)
    finally:
        program.comm_slot.comm, program.comm_slot.ep = real, real_ep
        if cp is not None:
            cp.comm = real_cp


__all__ = ["CommSlot", "Program", "build_program", "check_shapes"]
