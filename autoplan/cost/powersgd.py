"""What PowerSGD gradient compression sends, computes and keeps (Vogels et al., "PowerSGD:
Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019), as torch's
DDP communication hook ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` runs it.

Per gradient, viewed as an n x m matrix (its first dim by the rest), with rank
r = min(n, m, ``powersgd_rank``): compressed only where (n + m) r x ``MIN_COMPRESSION_RATE`` <
n m (the hook's ``_should_compress``; a 1-D gradient, n x 1, never is). A compressed gradient M
(with the error of the last step added back) sends P = M Q (n x r), all-reduced and
orthogonalised, then Q = M^T P (m x r), all-reduced, and is replaced by P Q^T: three products
of 2 n m r flops each, the Gram-Schmidt of P (about 2 n r^2), and the error feedback (the
residual M - P Q^T kept for the next step: one fp32 copy of every gradient the hook sees, the
whole bucket). The rest is all-reduced whole, in one flattened call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoplan.graph.opgraph import OpGraph

# the hook's default ``min_compression_rate``: a matrix is compressed where that saves 2x
MIN_COMPRESSION_RATE = 2.0
# passes over a compressed gradient's fp32 elements outside the products: the error added
# back (read 2, write 1), the residual kept (read 2, write 1), the result copied back (2)
ERROR_FEEDBACK_PASSES = 8


@dataclass(frozen=True, kw_only=True)
class PowerSGDCost:
    """One replica's gradients under rank-``rank`` PowerSGD, as fractions of its elements (so
    that a stage holding a share of the weights, after tensor parallelism, scales them)."""

    rank: int
    elements: float             # gradient elements of the model (distinct parameters)
    p_elements: float           # sent as P factors (n r per compressed matrix)
    q_elements: float           # sent as Q factors (m r per compressed matrix)
    whole_elements: float       # sent uncompressed (1-D and small matrices)
    compressed_elements: float  # of ``elements``, in compressed matrices
    flops: float                # the products and the orthogonalisation, per step
    matrices: int               # compressed gradients (kernel launches scale with them)

    @property
    def sent_fraction(self) -> float:
        """Elements all-reduced per step over the uncompressed all-reduce's."""
        return (self.p_elements + self.q_elements + self.whole_elements) / max(self.elements, 1.0)


def powersgd_cost(graph: OpGraph, rank: int) -> PowerSGDCost:
    """What rank-``rank`` PowerSGD sends and computes for ``graph``'s trainable parameters
    (cached per graph and rank)."""
    cache = graph.__dict__.setdefault("_autoplan_powersgd", {})
    if rank in cache:
        return cache[rank]
    total = p = q = whole = compressed = flops = 0.0
    matrices = 0
    for v in graph.params:
        shape = v.meta.shape
        numel = float(v.meta.numel)
        total += numel
        n = shape[0] if shape else 1
        m = int(numel) // max(n, 1)
        r = min(n, m, rank)
        if len(shape) >= 2 and (n + m) * r * MIN_COMPRESSION_RATE < n * m:
            p += n * r
            q += m * r
            compressed += numel
            flops += 3 * 2.0 * n * m * r + 2.0 * n * r * r
            matrices += 1
        else:
            whole += numel
    out = PowerSGDCost(rank=rank, elements=total, p_elements=p, q_elements=q,
                       whole_elements=whole, compressed_elements=compressed, flops=flops,
                       matrices=matrices)
    cache[rank] = out
    return out


def powersgd_buffer_bytes(graph: OpGraph, config: Any, params: float) -> float:
    """Device bytes the hook keeps between steps for a rank holding ``params`` of the
    gradient elements: the error feedback (an fp32 copy of each bucket it sees: every
    gradient) and the warm-started P and Q factors. 0 without compression."""
    if config.grad_compression != "powersgd":
        return 0.0
    c = powersgd_cost(graph, config.powersgd_rank)
    share = params / max(c.elements, 1.0)
    return share * (c.elements + c.p_elements + c.q_elements) * FP32_BYTES


FP32_BYTES = 4
