"""From a plan to what each module needs on the tp axis: its style and its tensor layouts.

The plan names one strategy per op (``Plan.op_strategies``). Rebuilt on the traced graph they
give a ``Sharding``; for every module that owns parameters we read off
- the placement its input arrives in (where the producing op left it),
- the placement its strategy wants the input in,
- the placement its output leaves in,
and the runtime style. ``RUNTIME_STYLES`` in ``autoplan.sharding.strategies`` is the one list of
styles; ``parallelize.py`` maps each to a PyTorch ``ParallelStyle``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor import Partial as DPartial

from autoplan.errors import PlanError
from autoplan.graph.opgraph import OpGraph
from autoplan.sharding.placement import REPLICATE, Placement
from autoplan.sharding.sharding import Sharding
from autoplan.sharding.strategies import RUNNABLE_STYLES, strategies


def to_dtensor(p: Placement):
    """The DTensor placement of an autoplan placement."""
    if p.kind == "S":
        return Shard(p.dim)
    if p.kind == "P":
        return DPartial()
    return Replicate()


@dataclass(frozen=True)
class ModuleLayout:
    fqn: str
    style: str
    arrives: Placement        # the input as the producer left it (local tensor of this placement)
    wants: Placement          # the input as the strategy needs it
    leaves: Placement         # the output


def sharding_from_plan(graph: OpGraph, op_strategies: dict[str, str], t: int) -> Sharding:
    """Rebuild the plan's Sharding on the traced graph (strategy names per op)."""
    chosen = []
    for op in graph.ops:
        name = op_strategies.get(op.name)
        if name is None:
            raise PlanError(f"the plan has no strategy for op {op.name!r}: it was made for "
                            "another graph; re-plan")
        options = {s.name: s for s in strategies(graph, op, t)}
        if name not in options:
            raise PlanError(f"op {op.name!r} has no strategy {name!r} on a {t}-way tp axis "
                            f"(it has {sorted(options)}); re-plan")
        chosen.append(options[name])
    return Sharding.build(graph, t, chosen)


def _in_module(path: str, fqn: str) -> bool:
    return path == fqn or path.startswith(fqn + ".")


def module_layouts(graph: OpGraph, sh: Sharding) -> dict[str, ModuleLayout]:
    """One layout per module that owns parameters: its input is the first activation entering
    the module's ops (a norm written as several ops starts at its first op), its style is the
    strategy of the op that reads its weight."""
    out: dict[str, ModuleLayout] = {}
    for i, (op, s) in enumerate(zip(graph.ops, sh.op_strategy)):
        fqn = op.module_path
        if not op.params or fqn in out or not op.outputs:
            continue
        if s.style not in RUNNABLE_STYLES:
            raise PlanError(f"module {fqn!r} uses style {s.style!r}, which the runtime cannot "
                            "run yet; re-plan with this autoplan")
        first = i
        while first > 0 and _in_module(graph.ops[first - 1].module_path, fqn):
            first -= 1
        inside = {n for k in range(first, i + 1) for n in graph.ops[k].outputs}
        entry = None
        for k in range(first, i + 1):
            if not graph.ops[k].outputs:
                continue              # metadata checks take their inputs as they come
            for slot, n in enumerate(graph.ops[k].inputs):
                if graph.value(n).kind in ("activation", "input") and n not in inside:
                    entry = (k, slot, n)
                    break
            if entry is not None:
                break
        if entry is None:
            continue
        k, slot, x = entry
        ks = sh.op_strategy[k]
        arrives = sh.value_placement.get(x, REPLICATE) if graph.value(x).kind == "activation" \
            else REPLICATE
        wants = ks.inputs[slot] if slot < len(ks.inputs) else REPLICATE
        style = s.style
        if style == "local":          # a module written as element-wise ops (an RMSNorm)
            style = ("replicate" if wants.kind == "R" else
                     "seq" if wants == Placement("S", 1) else
                     "batch" if wants == Placement("S", 0) else "")
            if not style:
                raise PlanError(f"module {fqn!r}: its ops are split on dim {wants.dim}, which "
                                "no runtime style expresses; re-plan")
        out[fqn] = ModuleLayout(fqn=fqn, style=style, arrives=arrives, wants=wants,
                                leaves=s.outputs[0] if s.outputs else REPLICATE)
    return out


def uses_loss_parallel(sh: Sharding) -> bool:
    return any(s.style == "loss_parallel" for s in sh.op_strategy)
