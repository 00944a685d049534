"""The values the sharding ILP's per-strategy prices are computed from: ``CostContext`` (one
mesh, micro-batch and policy) and ``ExpertExchanges`` (expert parallelism's all-to-alls as the
ILP prices them). ``problem`` builds the ILP from them, and the pricing functions beside it
(``axis_costs``, ``kept_activations``) read them; they live apart so that no pricing module
imports the ILP's builder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from autoplan.cost.compute import ComputeModel
from autoplan.cost.dtypes import HeldBytes
from autoplan.estimate.overlap import OVERLAP_INTERFERENCE
from autoplan.graph.opgraph import OpGraph
from autoplan.sharding.context_axis import ContextAxis
from autoplan.sharding.doc_work import PackedWork


@dataclass(frozen=True)
class ExpertExchanges:
    """Expert parallelism's exchanges as the ILP prices them, on the estimate's terms
    (``range_comm.ep_comm_s``): the rows each dispatch sends and each combine brings home,
    forward and backward, at the tp-local size the strategy gives them. Where they happen is
    taken from the widest regions (``expert_regions`` of the replicated sharding: the rows stay
    with their experts through every row-wise op between an MoE block's grouped products);
    a strategy that breaks a region pays the extra exchange in ``estimate`` only."""

    dispatch: Mapping[int, tuple[str, ...]]   # expert op -> values it sends to the experts
    # (first reader, other reader, value): a value two products read (w1 and w3) is sent
    # again when the other reads it placed differently (``ep_comm_s``: once per placement)
    again: tuple[tuple[int, int, str], ...]
    combine: frozenset[str]                   # values brought home
    a2a_s: Callable[[float], float]           # bytes -> seconds of an all-to-all on the ep group
    counts_s: float                           # each dispatch's all-gather of the row counts
    load: float = 1.0                         # the busiest rank's rows / the balanced share
    members: frozenset[int] = frozenset()     # ops on the dispatched rows (their work: x load)


@dataclass(frozen=True)
class CostContext:
    """Everything the per-strategy costs depend on (one mesh, micro-batch and policy)."""

    graph: OpGraph
    t: int
    compute: ComputeModel
    collective_s: Callable[[str, float], float]   # (kind, nbytes) -> seconds on the tp group
    batch_scale: float                            # micro-batch / traced batch
    microbatches: int
    precision: str
    recompute: str                                # none | selective | full
    state_bytes_per_param: float                  # weights + grads + optimizer on the device
    activation_multiplier: float                  # micro-batches whose activations are held
    memory_budget: float | None = None
    interference: float = OVERLAP_INTERFERENCE    # overlapped traffic's share charged
    experts: ExpertExchanges | None = None        # expert parallelism's exchanges (ep > 1)
    pinned: Mapping[int, str] | None = None       # op index -> the only strategy it may take
    step_shard: int = 1       # ZeRO-2/3: the tp step all-reduces gradients already dp-sharded
    # context parallelism on an axis of its own: the sequence split under the tp axis, and
    # (kind, nbytes) -> seconds on its group
    context: ContextAxis | None = None
    cp_collective_s: Callable[[str, float], float] | None = None
    held: HeldBytes | None = None     # the dtypes autocast holds activations in (cost.dtypes)
    documents: PackedWork | None = None   # packed documents (``--seq-lengths``: doc_work)

    @property
    def micro_batch(self) -> int:
        return max(1, round(self.batch_scale * self.graph.batch_size))
