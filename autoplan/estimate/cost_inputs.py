"""What a range's cost reads and what it is: the typed values ``chunk_cost`` passes between the
estimate's stages, and the share of an op's traced work one rank does.

``CostInputs``: one model, sharding, device model and configuration. ``RangeCost``: one op
range's per-micro-batch costs (a layer, a chunk). ``op_work``: an op's work on one rank
relative to its traced work (the micro-batch, its tensor- and context-parallel shard, packed
documents' masked share).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.cost.compute import ComputeModel
from autoplan.cost.dtypes import HeldBytes, held_bytes
from autoplan.estimate.activation_offload import ChunkOffload
from autoplan.graph.analysis import GraphAnalysis
from autoplan.graph.opgraph import OpGraph
from autoplan.sharding.context_axis import ContextAxis
from autoplan.sharding.doc_work import PackedWork, attention_share
from autoplan.sharding.parallel_config import ParallelConfig
from autoplan.sharding.ring_work import tp_work_share
from autoplan.sharding.sharding import Sharding
from autoplan.sharding.strategy import OpStrategy, divided_split


@dataclass(frozen=True)
class CostInputs:
    """What every range cost reads: one model, sharding, device model and configuration."""

    graph: OpGraph
    analysis: GraphAnalysis
    sharding: Sharding
    compute: ComputeModel
    cluster: Any
    config: ParallelConfig
    # expert parallelism: the busiest rank's routed rows over the balanced share (a router
    # with capacity factor c sends an expert at most c times its share, Fedus et al. 2021)
    expert_load: float = 1.0
    # context parallelism on an axis of its own (config.cp > 1): the sequence split over it
    context: ContextAxis | None = None
    # packed documents behind a document mask (``--seq-lengths``): attention's work is theirs
    documents: PackedWork | None = None

    @property
    def batch_scale(self) -> float:
        return self.config.micro_batch_size / self.graph.batch_size

    @property
    def held(self) -> HeldBytes | None:
        """The dtypes the runtime holds activations in (autocast), None for ``precision``."""
        return held_bytes(self.graph, self.config.precision, self.config.mixed_precision,
                          self.cluster.device.kind)


@dataclass(frozen=True)
class RangeCost:
    """Costs of one contiguous op range for one micro-batch (a layer, a chunk, ...)."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    tp_fwd_s: float
    tp_bwd_s: float
    tp_step_s: float              # once per step: tp-axis gradient all-reduces (replicated weights)
    activation_bytes: float
    working_set_bytes: float
    params: float                 # parameters per device (after TP sharding)
    param_tensors: int            # parameter tensors (an optimizer's per-tensor costs)
    num_layers: int = 0
    boundary_bytes: float = 0.0   # chunks: activation sent to the next chunk per micro-batch
    layer_params: float = 0.0     # chunks: of ``params``, those inside its layers
    ep_fwd_s: float = 0.0         # expert parallelism: the routed rows' all-to-all exchanges
    ep_bwd_s: float = 0.0
    expert_params: float = 0.0    # of ``params``, expert weights' slabs (their grads: over edp)
    cp_s: float = 0.0             # of ``tp_fwd_s + tp_bwd_s``, ring attention's exposed passes
    # of ``activation_bytes``, tensors made outside the layers and kept by several (a mask):
    # a chunk holds each once (``_chunk_cost``)
    shared_acts: tuple[tuple[str, float], ...] = ()
    # of ``activation_bytes``, the range's inputs it keeps (made before it; shared ones aside):
    # a chunk's received input, which the pipeline schedule holds anyway (``activation_offload``)
    input_acts: tuple[tuple[str, float], ...] = ()
    # of ``params``: (FQN, elements held) per parameter storage (``ParallelConfig.dp_whole``
    # picks some by name)
    param_elements: tuple[tuple[str, float], ...] = ()
    # chunks: the layers whose saved activations go to host memory (``activation_offload``):
    # ``activation_bytes`` is net of them, ``*_total_s`` include their exposed copies
    offload: ChunkOffload = ChunkOffload()

    def elements_of(self, keep: Any) -> float:
        """Of ``params``, the elements of the parameters whose FQN ``keep`` accepts."""
        return sum(n for fqn, n in self.param_elements if keep(fqn))

    @property
    def fwd_total_s(self) -> float:
        return self.fwd_s + self.tp_fwd_s + self.ep_fwd_s + self.offload.fwd_exposed_s

    @property
    def bwd_total_s(self) -> float:
        return (self.bwd_s + self.tp_bwd_s + self.recompute_s + self.ep_bwd_s
                + self.offload.bwd_exposed_s)

    @property
    def time_s(self) -> float:
        return self.fwd_total_s + self.bwd_total_s


def work_scale(a: GraphAnalysis, graph: OpGraph, sh: Sharding, i: int,
                batch_scale: float, context: ContextAxis | None = None,
                documents: PackedWork | None = None) -> float:
    """Work of op ``i`` relative to its traced work: the micro-batch, then its tp shard (and
    its cp shard), attention under packed ``documents`` at its slowest rank's masked share."""
    batch_dep = any(o in a.batch_dependent for o in graph.ops[i].outputs)
    return (batch_scale if batch_dep else 1.0) * shard_share(graph, sh.op_strategy[i], i,
                                                             context, documents)


def shard_share(graph: OpGraph, s: OpStrategy, i: int, context: ContextAxis | None,
                documents: PackedWork | None) -> float:
    """The share of op ``i``'s traced work (one micro-batch) its slowest rank does under tp
    strategy ``s`` and the cp axis ``context``: attention under packed ``documents`` at its
    ring's expected slowest share (``doc_work``), divided by the heads tp splits."""
    ring = s.work_divisor if s.kernel == "ring_attention" else 1
    docs = attention_share(graph, i, documents, context.c if context is not None else 1,
                           context.layout if context is not None else "", ring)
    if docs is not None:
        return docs / (s.work_divisor // ring)
    cp = context.op_scale(i) if context is not None else 1.0
    return cp * tp_work_share(graph, i, s.kernel, s.work_divisor)


def op_work(ci: CostInputs, i: int) -> tuple[float, tuple[str, int]]:
    """Op ``i``'s work on one rank relative to its traced work, and the product side its tp
    strategy divides (``ComputeModel.op_cost``'s arguments; expert load left out)."""
    return (work_scale(ci.analysis, ci.graph, ci.sharding, i, ci.batch_scale, ci.context,
                        ci.documents),
            divided_split(ci.graph, ci.graph.ops[i], ci.sharding.op_strategy[i]))
