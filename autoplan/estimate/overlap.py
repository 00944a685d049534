"""Communication that runs beside compute: what of it still adds to the step.

One rule for every overlap the estimate prices (FSDP's gathers behind the layers, DDP's buckets
behind the backward, ZeRO-1's updated weights behind the next forward, tensor-parallel
collectives pipelined with their GEMMs): what does not fit in the compute window, at least the
part that must come first, plus a share of the rest (the interference).
"""

from __future__ import annotations

from typing import Any

# Communication overlapped with compute still slows it: NCCL's kernels run on the SMs and share
# HBM bandwidth with the GEMMs they hide behind. The compute that runs beside a collective is
# charged this fraction of the overlapped time: measured, an average compute slowdown of 18.9 %
# (at most 40 %) while overlapped with the collectives of GPT and Llama training on 4 A100, H100,
# MI250 and MI210 (Lee et al. 2025, "Characterizing Compute-Communication Overlap in
# GPU-Accelerated Distributed Deep Learning", arXiv:2507.03114). A device may set its own
# (``DeviceSpec.overlap_interference``: CPU ranks 1.0).
OVERLAP_INTERFERENCE = 0.189


def overlap_exposed_s(comm_s: float, window_s: float, first_s: float,
                      interference: float = OVERLAP_INTERFERENCE) -> float:
    """Seconds ``comm_s`` of communication adds to a phase of ``window_s`` seconds of compute
    it overlaps: what does not fit in the window (at least ``first_s``, the part that must come
    before any compute, e.g. the first layer's gather) plus the interference of the rest."""
    if comm_s <= 0:
        return 0.0
    if interference >= 1.0:          # nothing runs beside it: all of it adds to the phase
        return comm_s
    return max(comm_s - window_s, first_s) + interference * min(comm_s, window_s)


def overlap_interference(cluster: Any) -> float:
    """The device's share of overlapped communication charged to compute (see
    ``DeviceSpec.overlap_interference``), else ``OVERLAP_INTERFERENCE``."""
    x = getattr(cluster.device, "overlap_interference", None)
    return OVERLAP_INTERFERENCE if x is None else float(x)
