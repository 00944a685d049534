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
   ``view(b, s, 8, 64)`` on 2 ranks; ``local_args.py``), and the output-side collective
   (``tp_comm``);
4. ``program_check.check_shapes`` then checks the result on fake tensors: every op's local
   output must have the shape its placement says, else the plan is refused before any
   collective runs.

With context parallelism on its own axis (``ParallelConfig.cp``) every op also takes its
strategy on that axis (``sharding/context_axis.py``), applied outside the tp one: an input is
moved on the cp axis, then on tp; the op computes on the piece both leave it; its outputs are
reduced or gathered on tp, then on cp. A weight read by an op not split over cp has its
gradient scaled by ``1 / cp`` on the way back (the dp x cp average would count it cp times).

The collectives read their process group from ``program.comm_slot`` at call time, so the same
program is checked with ``ShapeComm`` and then run with the real group.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autoplan.errors import PlanError
from autoplan.graph.opgraph import Op, OpGraph
from autoplan.graph.export_reader import TRANSPARENT
from autoplan.graph.experts import GROUPED_MM
from autoplan.runtime.causal_mask import as_causal, causal_attention_nodes, drop_unused
from autoplan.runtime.document_attention import (document_attention_nodes,
                                                 kernel_document_attention, without_mask)
from autoplan.runtime.kernels import get_arg
from autoplan.runtime.local_args import (has_many_outputs, local_shape_args, map_devices,
                                        map_tensors, output_index)
from autoplan.runtime.program_experts import ExpertRows, ExpertSite
from autoplan.runtime.program_calls import (KERNEL_CALLS, call_gather, call_gather_sp, call_reduce,
                                            call_reduce_grad, call_reduce_scatter,
                                            kernel_add_bias, kernel_composed, kernel_dp_batch_norm,
                                            kernel_float8_linear,
                                            kernel_grad_scale,
                                            kernel_grouped_product, kernel_local_experts, kernel_norm,
                                            kernel_split_random, kernel_split_random_axes, transition)
from autoplan.sharding.context_axis import ContextAxis
from autoplan.sharding.placement import REPLICATE, Placement, local_shape
from autoplan.sharding.sharding import Sharding, mutates_input
from autoplan.sharding.strategy import OpStrategy, input_action, opname, output_action

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
    zigzag: bool = False        # the cp slot's layout is head-tail (``tp_comm``)


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
# the program attributes its communicating calls read: the tp axis's group, the cp axis's
COMM_SLOTS = ("_autoplan_comm", "_autoplan_cp_comm")


@dataclass(frozen=True)
class _OpSite:
    """One op of the graph as the builder copies it."""

    node: fx.Node               # its node in the exported graph
    i: int                      # its index in the OpGraph
    op: Op
    s: OpStrategy               # its strategy on the tensor-parallel axis
    c: OpStrategy | None        # on the context-parallel axis (None: no cp axis)


# ---- the builder ---------------------------------------------------------------------------------

class _Builder:
    def __init__(self, ep: Any, graph: OpGraph, sh: Sharding, *, prefix: str, t: int,
                 device: torch.device, state_tensor: Callable[[str, str, Placement], Any],
                 ep_size: int = 1, cp: ContextAxis | None = None,
                 fp8: tuple[str, frozenset[int]] = ("none", frozenset())):
        self.ep, self.eg, self.sh, self.prefix, self.t = ep, graph, sh, prefix, t
        self.cp = cp
        # (recipe, ops): the linears run as torchao's Float8Linear (``runtime/float8.py``)
        self.fp8_recipe, self.fp8_ops = fp8
        if cp is not None and ep_size > 1:
            raise PlanError("a plan with both context (cp) and expert (ep) parallelism cannot "
                            "run; re-plan with one of them")
        self.ep_size = ep_size
        self.device = device
        # attention whose mask is proven causal: run with is_causal=True, no mask (flash)
        self.causal = causal_attention_nodes(ep.graph, device)
        # attention within packed documents: flex attention's block mask on CUDA
        self.documents = document_attention_nodes(ep.graph, device)
        self.dropped_masks: list[fx.Node] = []
        self.state_tensor = state_tensor
        self.g = fx.Graph()
        self.env: dict[str, fx.Node] = {}          # value name -> local node
        self.alias: dict[str, str] = {}            # transparent node -> its value
        self.last_op = 0
        self.attrs: dict[str, Any] = {}
        self.step_params: set[str] = set()
        self.slot = CommSlot(comm=None, ep_size=ep_size)
        self.attrs[COMM_SLOTS[0]] = self.slot
        self.slot_node = self.g.get_attr(COMM_SLOTS[0])
        # expert parallelism: values held as dispatched rows (``program_experts.py``)
        self.xp = (ExpertRows(graph, sh, ep_size, self.emit, self.slot_node)
                   if ep_size > 1 else None)
        self.cp_slot = self.cp_node = None
        if cp is not None:
            self.cp_slot = CommSlot(comm=None, size=cp.c, zigzag=cp.layout == "zigzag")
            self.attrs[COMM_SLOTS[1]] = self.cp_slot
            self.cp_node = self.g.get_attr(COMM_SLOTS[1])
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
        drop_unused(self.g, self.dropped_masks)     # the masks no attention reads any more
        return self.g

    def _state(self, node: fx.Node, fqn: str, kind: str) -> None:
        p = self.placement(node.name)
        self.attrs[fqn] = self.state_tensor(fqn, kind, p)
        self.env[node.name] = self.g.get_attr(fqn)

    def _call(self, node: fx.Node) -> None:
        """Copy one op of the graph: its strategies on the axes, expert regions' held rows in
        place of its inputs, its inputs moved to where it takes them, its arguments made local,
        the op (or its kernel), then its outputs' collectives."""
        site = self._site(node)
        if site is None:
            return
        experts = self.xp.site(site.i, site.op) if self.xp is not None else None
        swapped = self.xp.read_held(site.op, experts, self.env) if experts is not None else {}
        inputs = self._inputs(node, site.op, site.s, site.i)
        state = (self.xp.state(site.i, site.op, site.s, experts, inputs)
                 if experts is not None else None)
        args, kwargs = self._local_args(site, inputs)
        if node.name in self.causal:
            mask = get_arg(node.target, args, kwargs, "attn_mask")
            self.dropped_masks += [mask] if isinstance(mask, fx.Node) else []
            args, kwargs = as_causal(args, kwargs)
        elif self._document_input(site) is not None:
            self.dropped_masks.append(get_arg(node.target, args, kwargs, "attn_mask"))
            args, kwargs = without_mask(args, kwargs)
        local_outs = self._local_outs(site)
        args = local_shape_args(site.op, self.eg, args, local_outs)
        out, bias = self._emit_op(site, args, kwargs, experts, state)
        self._emit_outputs(site, out, bias, local_outs, experts, state)
        self.env.update(swapped)

    def _document_input(self, site: _OpSite) -> str | None:
        """The position-ids value attention ``site`` runs flex attention within the documents
        of (``document_attention.py``); None off CUDA, on a ring, or for other ops."""
        pos = self.documents.get(site.node.name)
        return None if pos is None or site.s.kernel or site.c is not None else pos

    def _site(self, node: fx.Node) -> _OpSite | None:
        """The op of ``node`` with its strategies (None: a shape assert, not for local tensors).
        A PlanError when its tp strategy cannot run under its cp one."""
        i = self.eg.op_index(node.name)
        self.last_op = i
        op = self.eg.ops[i]
        s = self.sh.op_strategy[i]
        if not op.outputs:
            if "assert" in opname(op) or "constrain" in opname(op):
                return None     # metadata checks on the global shapes: not for local tensors
        c = self.cp.strategy(i) if self.cp is not None else None
        if c is not None:
            why = self.cp.tp_conflict(i, s, self.t)
            if why:
                raise PlanError(f"op {op.name} ({op.target}): its tp strategy {s.name} does "
                                f"not run under context parallelism over cp={self.cp.c} "
                                f"({why}); re-plan")
        return _OpSite(node=node, i=i, op=op, s=s, c=c)

    def _local_args(self, site: _OpSite, inputs: list[fx.Node]) -> tuple[Any, dict]:
        """The node's arguments with its tensor inputs replaced by their local nodes (in the
        order ``_inputs`` made them) and devices by this rank's."""
        node = site.node
        it = iter(inputs)

        def take(a: fx.Node):
            name = self.alias.get(a.name, a.name)
            if name in self.env and name in self.eg._values_by_name:
                return next(it)
            return self.env.get(name, a)
        args, kwargs = map_tensors(node.args, dict(node.kwargs), take)
        return map_devices(args, self.device), map_devices(kwargs, self.device)

    def _local_outs(self, site: _OpSite) -> list[tuple[int, ...]]:
        """This rank's shape of each output (expert weights' views: this rank's experts);
        PlanError when the strategy splits one unevenly."""
        op, s = site.op, site.s
        local_outs = [self._local_out(n, k, s, site.c) for k, n in enumerate(op.outputs)]
        if any(shape is None for shape in local_outs):
            raise PlanError(f"op {op.name} ({op.target}): strategy {s.name} splits an output "
                            "unevenly; re-plan")
        return self.xp.local_outs(op, local_outs) if self.xp is not None else local_outs

    def _emit_op(self, site: _OpSite, args: list, kwargs: dict,
                 experts: ExpertSite | None, state: fx.Node | None
                 ) -> tuple[fx.Node, fx.Node | None]:
        """(output, bias or None) of the op itself: a strategy's kernel (the cp axis's around
        tp's), a local kernel the op needs whatever its strategy, or the op as traced. A kernel
        that returns its bias apart has it added after the output's tp collective."""
        node, i, op, s, c = site.node, site.i, site.op, site.s, site.c
        if i in self.fp8_ops and (s.kernel or (c is not None and c.kernel)):
            raise PlanError(f"op {op.name} ({op.target}) of linear {op.module_path}: the plan "
                            f"runs it in fp8 and with kernel {s.kernel or c.kernel}, which "
                            "have no fp8 form; re-plan with max_tp=1 or without fp8")
        if c is not None and c.kernel:            # the cp axis's kernel (around tp's own)
            if s.kernel:
                return self.emit(kernel_composed, (node.target, args, kwargs, self.cp_node,
                                                   c.kernel, self.slot_node, s.kernel), i), None
            call = KERNEL_CALLS[c.kernel]
            if call.returns_bias:
                raise PlanError(f"op {op.name} ({op.target}): kernel {c.kernel} does not "
                                "run on the context-parallel axis; re-plan")
            return self.emit(call.fn, (node.target, args, kwargs, self.cp_node,
                                       *call.extra(self.eg, op, c)), i), None
        if s.kernel:                               # the strategy's local kernel
            call = KERNEL_CALLS[s.kernel]
            out = self.emit(call.fn, (node.target, args, kwargs, self.slot_node,
                                      *call.extra(self.eg, op, s)), i)
            if not call.returns_bias:
                return out, None
            # (output without bias, bias): the bias is added after the output's collective
            return (self.emit(operator.getitem, (out, 0), i),
                    self.emit(operator.getitem, (out, 1), i))
        local = self._local_kernel(site, experts, state)
        if local is not None:
            fn, extra = local
            return self.emit(fn, (node.target, args, kwargs, *extra), i), None
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
        return out, None

    def _traced_dtype(self, op: Any) -> torch.dtype | None:
        """The dtype of ``op``'s (first) output in the graph exported under the step's
        autocast: what one device computes it in."""
        dtype = self.eg.value(op.outputs[0]).meta.dtype if op.outputs else None
        return getattr(torch, dtype, None) if dtype else None

    def _local_kernel(self, site: _OpSite, experts: ExpertSite | None,
                      state: fx.Node | None) -> tuple[Callable, tuple] | None:
        """(kernel, its arguments after the op's) for an op that needs one whatever its
        strategy: this rank's experts, a grouped product, random ops on split tensors, batch
        and other norms. None: the op runs as traced."""
        node, op, s, c = site.node, site.op, site.s, site.c
        if self._document_input(site) is not None:
            return kernel_document_attention, (self.env[self._document_input(site)],)
        name = opname(op)
        seeded = _SEEDED in getattr(node.target, "tags", ())
        if experts is not None and experts.expert_op:
            return kernel_local_experts, (state, self._traced_dtype(op))
        if name in GROUPED_MM:
            return kernel_grouped_product, (self._traced_dtype(op),)
        if site.i in self.fp8_ops:
            if node.target is not torch.ops.aten.linear.default:
                raise PlanError(f"op {op.name} ({op.target}) of linear {op.module_path}: "
                                "the plan runs it in fp8, but only an aten.linear on this "
                                "rank's whole weight runs as torchao's Float8Linear; re-plan "
                                f"with fp8_skip={op.module_path!r} or without fp8")
            return kernel_float8_linear, (self.fp8_recipe,)
        if c is not None and seeded and any(p.kind == "S" for p in c.inputs + s.inputs):
            # a mask per piece over both axes (``kernels.split_random``)
            return kernel_split_random_axes, tuple(
                node_ if any(p.kind == "S" for p in st.inputs) else None
                for st, node_ in ((c, self.cp_node), (s, self.slot_node)))
        if self.t > 1 and seeded and any(p.kind == "S" for p in s.inputs):
            # dropout of a split tensor: a mask per rank (``kernels.split_random``)
            return kernel_split_random, (self.slot_node,)
        if name == "batch_norm":
            return kernel_dp_batch_norm, (self.slot_node,)
        if name in _NORMS:
            return kernel_norm, ()
        return None

    def _emit_outputs(self, site: _OpSite, out: fx.Node, bias: fx.Node | None,
                      local_outs: list[tuple[int, ...]], experts: ExpertSite | None,
                      state: fx.Node | None) -> None:
        """Each output taken from the op's result with its local shape, its tp collective,
        the bias, then its cp collective; inside an expert region held as dispatched rows and
        brought home (combined) where read from outside."""
        node, i, op, s, c = site.node, site.i, site.op, site.s, site.c
        stacked = experts is not None and experts.stacked
        for k, vn in enumerate(op.outputs):
            y = out if len(op.outputs) == 1 and not has_many_outputs(node) else \
                self.emit(operator.getitem, (out, output_index(node, vn)), i)
            y.meta[SHAPE] = local_outs[k] if not stacked else (
                local_outs[k][0] // self.ep_size, local_outs[k][1] * self.ep_size,
                *local_outs[k][2:])
            y = self._output_action(output_action(self.eg, op, s, k), y, s, k,
                                    self.slot_node, i)
            if bias is not None and k == 0:
                y = self.emit(kernel_add_bias, (y, bias, node.target), i)
            if c is not None:                   # then on the cp axis
                y = self._output_action(output_action(self.eg, op, c, k), y, c, k,
                                        self.cp_node, i)
            self.env[vn] = y
            if experts is not None:     # held dispatched; brought home where read from outside
                self.env[vn] = self.xp.hold(i, vn, y, state, experts)

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
        args, _ = map_tensors(node.args, {}, whole)
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


# ---- entry point -----------------------------------------------------------------------------

def build_program(ep: Any, graph: OpGraph, sharding: Sharding, *, prefix: str, t: int,
                  device: torch.device,
                  state_tensor: Callable[[str, str, Placement], Any],
                  ep_size: int = 1, cp: ContextAxis | None = None,
                  fp8: tuple[str, frozenset[int]] = ("none", frozenset())) -> Program:
    """The rank program of ``sharding`` over ``graph`` (an OpGraph of ``ep``). ``state_tensor``
    (fqn, "param"|"buffer", placement) returns this rank's local tensor of a parameter or
    buffer (already sharded, expert weights to this rank's experts). ``ep_size`` > 1: the
    grouped products run expert-parallel (``runtime/experts.py``). ``cp``: the sequence split
    over a context-parallel axis of its own as well. ``fp8`` (recipe, ops): those linears run
    as torchao's Float8Linear (``runtime/float8.py``)."""
    b = _Builder(ep, graph, sharding, prefix=prefix, t=t, device=device,
                 state_tensor=state_tensor, ep_size=ep_size, cp=cp, fp8=fp8)
    g = b.build()
    gm = fx.GraphModule(b.attrs, g, class_name="RankProgram")
    return Program(graph_module=gm, comm_slot=b.slot, step_params=sorted(b.step_params),
                   state=dict(sharding.state), cp_slot=b.cp_slot)


__all__ = ["CommSlot", "OP", "Program", "SHAPE", "VAL", "build_program"]
