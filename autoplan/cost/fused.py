"""What a compiled program (``ParallelConfig.compiled``) runs of the element-wise work: chains of
fusible ops as one kernel each (what inductor does), within the regions the runtime compiles.

The runtime compiles regionally (``runtime/parallelize.apply_compile``): each layer
(``graph.units.pipeline_units``) and each run of ops between layers
(``runtime/program_modules.split_outside``) is a region of its own, which reads its inputs from
memory and writes its outputs there, so a chain ends at a region's edge (``compiled_regions``).
``cost/compute.ComputeModel(fused=True)`` prices each fusible op by ``fused_traffic``.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import dataclass

from autoplan.graph.analysis import analyze
from autoplan.graph.opgraph import Op, OpGraph
from autoplan.graph.units import pipeline_units

# What torch.compile's inductor fuses: element-wise arithmetic, casts and copies, the
# reductions and norms around them (a norm is reductions and element-wise ops to it), dropout.
FUSIBLE_KINDS = frozenset({"pointwise", "norm", "dropout", "reduction", "copy", "creation"})


@dataclass(frozen=True)
class FusedTraffic:
    """One fusible op as a compiled program runs it: the share of its traced bytes that
    still moves through memory (inputs made outside its fused kernel, outputs read outside
    it) and whether it opens a kernel of its own (a launch)."""

    moved: float
    launches: bool


def fused_traffic(graph: OpGraph) -> dict[int, FusedTraffic]:
    """Per fusible op (``FUSIBLE_KINDS``), its traffic in a compiled program: a chain of such
    ops runs as one kernel that reads what the chain takes from outside (products' outputs,
    weights, inputs) and writes what is read outside it, once; views and identity dropouts
    pass through. A chain ends where the compiled program's regions do
    (``compiled_regions``): a layer's first op reads the layer's input and its last writes the
    layer's output, whatever fusible op sits on the other side. Kept on the graph.

    Left out (an approximation): a collective that a sharding puts between two ops of one
    chain (a reshard; the runtime runs it eagerly, a graph break) ends the chain there too,
    so the producer writes the value and the consumer reads it back. The sharding is chosen
    after this is priced, and the reshard's price could carry it, but it is small: Megatron's
    collectives sit on products' inputs and outputs, where chains end anyway, and the ILP's
    own choice for Llama-3-8B (dp4 x tp2, ZeRO-3) puts 64 of its 322 reshards inside chains
    (rotary's ``cat`` into ``mul``), which priced so (a write and a read of the collective's
    bytes) add 0.09 % to its step. (Pricing them moved that plan's reshards onto smaller
    tensors, and the weights it kept whole under ZeRO-3 no longer fit: a plan 0.7 % slower.)"""
    cached = graph.__dict__.get("_autoplan_fused")
    if cached is not None:
        return cached
    a = analyze(graph)
    ops = graph.ops
    region = compiled_regions(graph)
    through = {i for i, op in enumerate(ops)
               if op.inputs and (op.kind == "view" or op.kind == "dropout"
                                 and identity_dropout(op))}

    def source(n: str) -> int | None:       # the op that computed n, through views
        i = a.producer.get(n)
        while i is not None and i in through:
            i = a.producer.get(ops[i].inputs[0])
        return i

    def readers(n: str) -> list[int]:       # the ops that read n, through views
        out: list[int] = []
        for j in a.consumers.get(n, ()):
            if j in through:
                for o in ops[j].outputs:
                    out += readers(o)
            else:
                out.append(j)
        return out
    fused = {i for i, op in enumerate(ops) if op.kind in FUSIBLE_KINDS and i not in through}
    outputs = set(graph.outputs)
    out: dict[int, FusedTraffic] = {}
    for i in fused:
        op = ops[i]
        total = moved = 0.0
        inside = True
        for n in op.inputs:
            b = graph.value(n).meta.nbytes
            total += b
            j = source(n)
            if j not in fused or region[j] != region[i]:
                moved += b
                inside = False
        for n in op.outputs:
            b = graph.value(n).meta.nbytes
            total += b
            read = readers(n)
            if n in outputs or not read or any(j not in fused or region[j] != region[i]
                                               for j in read):
                moved += b
        out[i] = FusedTraffic(moved=moved / total if total else 1.0,
                              launches=not inside or not op.inputs)
    graph.__dict__["_autoplan_fused"] = out
    return out


def compiled_regions(graph: OpGraph) -> tuple[int, ...]:
    """Per op, the region of a compiled program it runs in: the runtime compiles each layer
    (``graph.units.pipeline_units``) on its own and each run of ops between layers (embedding
    and masks before the first, final norm, head and loss after the last) as a region of its
    own (``runtime/program_modules.split_outside``, ``parallelize.apply_compile``); a region
    reads its inputs from memory and writes its outputs there. A pipeline stage holds whole
    units, so its edges are region edges too. (A model without layers is compiled whole, and
    its pipeline stages, cut by FLOPs, are not known here: one region.)"""
    edges = sorted({e for u in pipeline_units(graph) for e in (u.start, u.stop)})
    return tuple(bisect_right(edges, i) for i in range(len(graph.ops)))


def identity_dropout(op: Op) -> bool:
    """Dropout with p = 0 (or not training) returns its input: torch launches no kernel."""
    try:
        call = json.loads(op.args)
        args, kwargs = call.get("args", []), call.get("kwargs", {})
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else kwargs.get("train", True)
        return float(p) == 0.0 or train is False
    except (ValueError, TypeError, AttributeError, IndexError):
        return False
