"""Which pieces of each global tensor this rank holds: the bridge between the runtime's sharded
state and a plan-independent checkpoint.

A rank's copy of a parameter (or of its optimizer state) is a tensor-parallel shard (a plain
tensor, ``S(d)``, ``S(d)[k]`` or replicated: ``program.py``), perhaps further split over the
data-parallel axis by FSDP2 (a ``DTensor`` whose local tensor is a slab of dim 0, chunked
unevenly), perhaps held only by the ZeRO-1 owner or only by one pipeline rank. Whatever the
layers, the local tensor is a few rectangular pieces of the global tensor; :class:`Pieces` lists
them with their global offsets, which is all ``torch.distributed.checkpoint`` (DCP) needs to
write them and, under another plan, to read any other rank's pieces back (resharding).

Per dim, a local tensor is a list of :class:`Segment` (local start, global start, length); the
pieces are the product of the dims' segments. ``S(d)[k]`` gives ``k`` segments on dim ``d``
(one per block), everything else one per dim.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.tensor import DTensor

from autoplan.errors import PlanError
from autoplan.sharding.placement import Placement


@dataclass(frozen=True)
class Segment:
    """``length`` elements of one dim: local index ``local_start`` is global ``global_start``."""

    local_start: int
    global_start: int
    length: int


def tp_segments(global_shape: tuple[int, ...], p: Placement, t: int,
                rank: int) -> list[list[Segment]]:
    """Per dim, the segments of the tensor-parallel shard rank ``rank`` of ``t`` holds."""
    segs = [[Segment(0, 0, n)] for n in global_shape]
    if p.kind != "S" or t == 1:
        return segs
    n = global_shape[p.dim]
    k = p.blocks
    if n % (k * t):
        raise PlanError(f"a dim of {n} cannot be split in {k} block(s) over {t} ranks")
    block, piece = n // k, n // (k * t)
    segs[p.dim] = [Segment(j * piece, j * block + rank * piece, piece) for j in range(k)]
    return segs


def global_shape_of(local_shape: tuple[int, ...], p: Placement | None,
                    t: int) -> tuple[int, ...]:
    """The whole tensor's shape from a tensor-parallel shard's."""
    shape = list(local_shape)
    if p is not None and p.kind == "S" and t > 1:
        shape[p.dim] *= t
    return tuple(shape)


def restrict(segs: list[list[Segment]], dim: int, start: int,
             length: int) -> list[list[Segment]]:
    """The segments of the slab ``[start, start + length)`` of local dim ``dim``, re-based to
    the slab (how an FSDP2 shard of a tensor-parallel shard maps back)."""
    out = []
    for s in segs[dim]:
        lo, hi = max(s.local_start, start), min(s.local_start + s.length, start + length)
        if hi > lo:
            out.append(Segment(lo - start, s.global_start + lo - s.local_start, hi - lo))
    return [out if d == dim else list(v) for d, v in enumerate(segs)]


class Pieces:
    """One state tensor of this rank as pieces of its global tensor, in the protocol DCP
    checkpoints (``__create_write_items__`` / ``__create_chunk_list__`` /
    ``__get_tensor_shard__``). Reads write through to ``local``."""

    def __init__(self, global_shape: tuple[int, ...], local: torch.Tensor,
                 segs: list[list[Segment]]):
        self.global_shape = torch.Size(global_shape)
        self.local = local
        self.pieces: list[tuple[torch.Size, torch.Size, torch.Tensor]] = []
        if local.dim() == 0:
            self.pieces.append((torch.Size(()), torch.Size(()), local))
            return
        for combo in itertools.product(*segs):
            view = local
            for d, s in enumerate(combo):
                view = view.narrow(d, s.local_start, s.length)
            if view.numel() == 0:
                continue
            self.pieces.append((torch.Size(s.global_start for s in combo),
                                torch.Size(s.length for s in combo), view))

    def size(self) -> torch.Size:
        return self.global_shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties.create_from_tensor(self.local)
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                              properties=props, size=self.global_shape))
                for offsets, sizes, _ in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, _, view in self.pieces:
            if index.offset is None or torch.Size(index.offset) == offsets:
                return view
        raise KeyError(f"{index.fqn}: this rank holds no piece at {index.offset}")


@dataclass(frozen=True)
class Layout:
    """Where a rank's copy of one tensor lies in the global tensor."""

    global_shape: tuple[int, ...]
    segs: tuple[tuple[Segment, ...], ...]

    def pieces(self, local: torch.Tensor) -> Pieces:
        """``local`` (a tensor of this rank's local shape: the copy itself, or optimizer state
        shaped like it) as pieces of the global tensor."""
        if isinstance(local, DTensor):
            local = local.to_local()
        return Pieces(self.global_shape, local.detach(), [list(s) for s in self.segs])


def layout_of(tensor: torch.Tensor, p: Placement | None, t: int, tp_rank: int,
              expert: tuple[int, int] | None = None) -> Layout:
    """The layout of ``tensor``, this rank's copy: a tensor-parallel shard under ``p``, for an
    expert weight (``expert`` = (ep, index)) the index-th of ``ep`` slabs of its leading
    (expert) dim, maybe an FSDP2 ``DTensor`` over either."""
    slab = None
    if isinstance(tensor, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        sizes, offsets = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements)
        shard_dims = [d for d, (n, m) in enumerate(zip(tensor.shape, sizes)) if n != m]
        if len(shard_dims) > 1:
            raise PlanError(f"a data-parallel DTensor sharded on dims {shard_dims}; checkpoints "
                            "take one sharded dim")
        if shard_dims:
            slab = (shard_dims[0], offsets[shard_dims[0]], sizes[shard_dims[0]])
    shape = tuple(tensor.shape)                  # a DTensor's: the shard FSDP2 split
    if expert is not None and expert[0] > 1:
        ep, index = expert
        rows = shape[0]
        whole = global_shape_of((rows * ep,) + shape[1:], p, t)
        segs = tp_segments(whole, p if p is not None else Placement("R"), t, tp_rank)
        segs = restrict(segs, 0, index * rows, rows)
    else:
        whole = global_shape_of(shape, p, t)
        segs = tp_segments(whole, p if p is not None else Placement("R"), t, tp_rank)
    if slab is not None:
        segs = restrict(segs, *slab)
    return Layout(whole, tuple(tuple(s) for s in segs))
