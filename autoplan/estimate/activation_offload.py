"""What offloading a layer's saved activations to host memory saves and costs, per layer
(``ParallelConfig.offload_activations``; the runtime's ``runtime/activation_offload.py``).

Per micro-batch, a layer that offloads moves what it keeps for backward (``RangeCost.
activation_bytes``: everything it saves without recomputation, its checkpoint's input under
full recomputation), less the tensors made outside the layers that every layer reads (a mask,
rotary tables: held once for the chunk, never offloaded) and, for the first layer of a chunk
that receives its input from another (a pipeline stage after the first), less that input: the
schedule holds it for its backward whatever the layer does (``torch.distributed.pipelining``
keeps each stage's inputs in its forward cache), so copying it would free nothing. The rest goes
to the host in forward and back in backward, over the device's own link to the host (``HostSpec.device_to_host_bandwidth_bytes_
per_s``, per device, as optimizer offload prices it). The device no longer holds those bytes
between its forward and its backward; it holds one layer's copy in flight on top (the
transient).

Overlap: the copy to the host runs while the part after the layer computes its forward (the
next layer, or the ops after the layers), the copy back while that part computes its backward
(backward runs in reverse, so the prefetch of layer i is issued when layer i + 1's backward
starts, Megatron-Core's fine-grained offloading); a layer with nothing after it in its chunk
has nothing to hide behind: its copies are exposed whole. Copies run on the device's copy
engines, not its compute units, so the compute they overlap is not slowed (CUDA C Programming
Guide, "Asynchronous Concurrent Execution": copies overlap kernels on devices with
asyncEngineCount > 0); on a CPU rank (overlap interference 1) nothing overlaps.

With recomputation: a fully recomputed layer keeps only its checkpoint's input, which is what
it moves. Under the op-level policy (``ops``) torch's selective checkpointing keeps the
products' outputs in its own cache, which saved-tensor hooks never see: such a layer moves its
checkpoint's input alone, the products stay on the device (measured: the hooks copy the same
bytes under ``ops`` as under ``full``).

``layer_offload`` is the per-layer price (device bytes saved, seconds exposed) that the joint
recompute/offload DP (``planner/recompute_dp.py``) weighs against recomputation;
``chunk_offload`` applies the config's choice (the first ``offload_activations`` layers of
every chunk, or the layers ``layer_offload`` marks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from autoplan.estimate.overlap import overlap_exposed_s, overlap_interference


@dataclass(frozen=True)
class LayerOffload:
    """One layer's offload per micro-batch: ``moved_bytes`` each way (= the device bytes it
    saves), the copy's seconds, and what of them its forward and backward expose."""

    path: str
    moved_bytes: float
    copy_s: float
    fwd_exposed_s: float
    bwd_exposed_s: float

    @property
    def exposed_s(self) -> float:
        return self.fwd_exposed_s + self.bwd_exposed_s


@dataclass(frozen=True)
class ChunkOffload:
    """The offloading layers of one chunk, and their sums per micro-batch."""

    layers: tuple[LayerOffload, ...] = ()

    @property
    def moved_bytes(self) -> float:
        return sum(l.moved_bytes for l in self.layers)

    @property
    def fwd_exposed_s(self) -> float:
        return sum(l.fwd_exposed_s for l in self.layers)

    @property
    def bwd_exposed_s(self) -> float:
        return sum(l.bwd_exposed_s for l in self.layers)

    @property
    def in_flight_bytes(self) -> float:
        """The device bytes of one layer's copy in flight (to the host or back)."""
        return max((l.moved_bytes for l in self.layers), default=0.0)


def layer_offload(cluster: Any, path: str, layer: Any, after: Any | None, *,
                  received: bool = False, policy: str = "none") -> LayerOffload:
    """The offload of ``layer`` (its ``RangeCost`` under recompute ``policy``) whose copies
    hide behind ``after`` (the ``RangeCost`` of the part after it in its chunk; None: nothing,
    exposed whole). ``received``: its inputs came from another chunk, which the pipeline holds
    (not moved)."""
    held = sum(b for _, b in layer.shared_acts)
    if received:
        held += sum(b for _, b in layer.input_acts)
    if policy == "ops":          # the products stay in selective checkpointing's cache
        held += layer.activation_bytes - sum(b for _, b in layer.shared_acts) - sum(
            b for _, b in layer.input_acts)
    moved = max(0.0, layer.activation_bytes - held)
    copy_s = moved / cluster.host.device_to_host_bandwidth_bytes_per_s
    # copy engines: the overlapped compute is not slowed, but a CPU rank overlaps nothing
    x = 1.0 if overlap_interference(cluster) >= 1.0 else 0.0
    fwd_window = after.fwd_total_s if after is not None else 0.0
    bwd_window = after.bwd_total_s if after is not None else 0.0
    return LayerOffload(path=path, moved_bytes=moved, copy_s=copy_s,
                        fwd_exposed_s=overlap_exposed_s(copy_s, fwd_window, 0.0, x),
                        bwd_exposed_s=overlap_exposed_s(copy_s, bwd_window, 0.0, x))


def chunk_offload(cluster: Any, offloaded: Sequence[bool], paths: Sequence[str],
                  parts: Sequence[Any], is_layer: Sequence[bool], *,
                  policies: Sequence[str] = (), received: bool = False) -> ChunkOffload:
    """The offload of the chunk's layers ``offloaded`` marks (one flag per layer) whose parts
    (layers and the ops around them, in order) cost ``parts``; ``paths``: its layers' module
    paths; ``policies``: their recompute policies (default none); ``received``: the chunk's
    input comes from another chunk (its first part, if a layer, keeps it held)."""
    if not any(offloaded):
        return ChunkOffload()
    out = []
    k = 0
    for i, (part, layer) in enumerate(zip(parts, is_layer)):
        if not layer:
            continue
        if k < len(offloaded) and offloaded[k]:
            after = parts[i + 1] if i + 1 < len(parts) else None
            out.append(layer_offload(cluster, paths[k], part, after,
                                     received=received and i == 0,
                                     policy=policies[k] if k < len(policies) else "none"))
        k += 1
    return ChunkOffload(tuple(out))
