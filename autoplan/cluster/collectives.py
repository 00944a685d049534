"""Alpha-beta cost of collectives on a device group.

A group is first reduced to a :class:`GroupProfile` (bandwidths and per-step latencies derived
from the topology, see ``topology.py``); the formulas here only combine those numbers.

``nbytes`` is always the size of the FULL buffer on each rank: the tensor for all_reduce and
broadcast, the gathered output for all_gather, the unreduced input for reduce_scatter, and what
one rank sends in total for all_to_all. With ``n`` ranks and per-rank ring bandwidth ``B``:

* all_reduce (ring: reduce-scatter then all-gather): ``2(n-1)/n * nbytes / B + 2(n-1) * a``
* all_gather, reduce_scatter (ring):                  ``(n-1)/n * nbytes / B + (n-1) * a``
* broadcast (pipelined chain, chunks stream through the ring, so the bandwidth term is one
  buffer's worth and the latency term is the pipeline fill): ``nbytes / B + (n-1) * a``
* all_to_all (direct exchange): every ordered pair moves ``nbytes / n``; the bandwidth term is
  the most loaded directed link inside a node, or the NIC share leaving a node (bisection of the
  fat tree, reduced by its oversubscription), whichever is slower; ``+ (n-1) * a``.

``a`` (alpha) is the latency of the slowest ring hop's path plus a per-step software overhead
(``STEP_OVERHEAD_S``, an estimate of the library's per-step cost: NCCL kernels synchronise each
step in about a microsecond; gloo goes through the CPU and the kernel's socket layer).

Groups that span several nodes with the same ``k > 1`` ranks on each also get the hierarchical
estimate (intra-node reduce-scatter, inter-node collective on ``nbytes / k`` where each of the
``k`` ranks uses its own NIC share, intra-node all-gather); the cheaper of flat and hierarchical
is reported, and both are kept in the :class:`CollectiveEstimate`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from autoplan.errors import ClusterError

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
STEP_OVERHEAD_S = {"nccl": 1.0e-6, "gloo": 10.0e-6}  # estimates, see the module docstring


def check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ClusterError(f"unknown collective {kind!r}; use one of {', '.join(COLLECTIVE_KINDS)}")


def collective_bytes_per_rank(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends on the wire: ring all-reduce ``2(n-1)/n * nbytes``; all-gather,
    reduce-scatter and all-to-all ``(n-1)/n * nbytes``; broadcast ``nbytes``. 0 for one rank."""
    check_kind(kind)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ClusterError(f"group size must be an integer >= 1, got {n!r}")
    if n == 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind == "broadcast":
        return float(nbytes)
    return (n - 1) / n * nbytes


@dataclass(frozen=True, kw_only=True)
class GroupProfile:
    """What the topology says about one group of ranks (per-rank bandwidths, per-step latencies)."""

    num_ranks: int
    num_nodes: int
    ranks_per_node: int                       # 0 when nodes hold different numbers of the ranks
    ring_bandwidth_bytes_per_s: float         # flat ring over all ranks (inf for one rank)
    ring_step_latency_s: float
    intra_bandwidth_bytes_per_s: float        # ring inside one node's members (slowest node)
    intra_step_latency_s: float
    inter_bandwidth_bytes_per_s: float        # one rank's NIC share, across nodes (inf on one node)
    inter_step_latency_s: float
    all_to_all_s_per_byte: float              # all-to-all bandwidth term per byte of nbytes


@dataclass(frozen=True, kw_only=True)
class CollectiveEstimate:
    """One priced collective: the chosen algorithm and the alternatives considered."""

    kind: str
    nbytes: float
    num_ranks: int
    algorithm: str                            # "none" (one rank), "ring", "direct", "hierarchical"
    time_s: float
    latency_s: float                          # the alpha part of time_s
    bandwidth_bytes_per_s: float              # bytes per rank on the wire / bandwidth part of time_s
    flat_time_s: float
    hierarchical_time_s: float | None


def estimate(kind: str, nbytes: float, profile: GroupProfile, *, step_overhead_s: float) -> CollectiveEstimate:
    _check_args(kind, nbytes)
    n = profile.num_ranks
    if n == 1:
        return CollectiveEstimate(kind=kind, nbytes=nbytes, num_ranks=1, algorithm="none", time_s=0.0, latency_s=0.0,
                                  bandwidth_bytes_per_s=math.inf, flat_time_s=0.0, hierarchical_time_s=None)
    flat_bw_s, flat_lat = _flat(kind, nbytes, profile, step_overhead_s)
    best = ("direct" if kind == "all_to_all" else "ring", flat_bw_s, flat_lat)
    hier_time = None
    hier = _hierarchical(kind, nbytes, profile, step_overhead_s)
    if hier is not None:
        hier_time = hier[0] + hier[1]
        if hier_time < flat_bw_s + flat_lat:
            best = ("hierarchical", *hier)
    algorithm, bw_s, lat = best
    wire = collective_bytes_per_rank(kind, nbytes, n)
    return CollectiveEstimate(
        kind=kind, nbytes=nbytes, num_ranks=n, algorithm=algorithm, time_s=bw_s + lat, latency_s=lat,
        bandwidth_bytes_per_s=wire / bw_s if bw_s > 0 else math.inf,
        flat_time_s=flat_bw_s + flat_lat, hierarchical_time_s=hier_time)


def _check_args(kind: str, nbytes: float) -> None:
    check_kind(kind)
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not 0 <= nbytes < math.inf:
        raise ClusterError(f"nbytes must be a finite number >= 0, got {nbytes!r}")


def estimate_time_s(kind: str, nbytes: float, profile: GroupProfile, *,
                    step_overhead_s: float) -> float:
    """``estimate(...).time_s`` without the breakdown (the cost model asks for it per tensor
    moved; the same figure, to the bit)."""
    _check_args(kind, nbytes)
    if profile.num_ranks == 1:
        return 0.0
    bw_s, lat = _flat(kind, nbytes, profile, step_overhead_s)
    hier = _hierarchical(kind, nbytes, profile, step_overhead_s)
    if hier is not None and hier[0] + hier[1] < bw_s + lat:
        bw_s, lat = hier
    return bw_s + lat


def _flat(kind: str, nbytes: float, p: GroupProfile, overhead: float) -> tuple[float, float]:
    """(bandwidth term, latency term) of the flat algorithm."""
    n, alpha = p.num_ranks, p.ring_step_latency_s + overhead
    if kind == "all_to_all":
        return nbytes * p.all_to_all_s_per_byte, (n - 1) * alpha
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return collective_bytes_per_rank(kind, nbytes, n) / p.ring_bandwidth_bytes_per_s, steps * alpha


def _hierarchical(kind: str, nbytes: float, p: GroupProfile, overhead: float) -> tuple[float, float] | None:
    k, nodes = p.ranks_per_node, p.num_nodes
    if nodes < 2 or k < 2 or kind == "all_to_all":
        return None
    a_in, a_out = p.intra_step_latency_s + overhead, p.inter_step_latency_s + overhead
    b_in, b_out = p.intra_bandwidth_bytes_per_s, p.inter_bandwidth_bytes_per_s
    intra_phase = (k - 1) / k * nbytes / b_in      # one intra-node reduce-scatter or all-gather
    if kind == "all_reduce":
        bw_s = 2 * intra_phase + 2 * (nodes - 1) / nodes * (nbytes / k) / b_out
        return bw_s, 2 * (k - 1) * a_in + 2 * (nodes - 1) * a_out
    if kind in ("all_gather", "reduce_scatter"):
        bw_s = intra_phase + (nodes - 1) / nodes * (nbytes / k) / b_out
        return bw_s, (k - 1) * a_in + (nodes - 1) * a_out
    # broadcast: pipelined across nodes through k NIC shares, then within each node
    return nbytes / min(b_in, k * b_out), (k - 1) * a_in + (nodes - 1) * a_out
