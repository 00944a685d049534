"""Mesh axes as a type: their names, the rank layout, the group of a rank on any set of axes,
and what each axis may carry.

Vocabulary (torchtitan's, written down in its ``ParallelDims``): a mesh **axis** is one
dimension of the device mesh (pp, dp, cp, tp, ...), named by a ``MeshAxis``; a tensor **dim**
is one dimension of a tensor (``S(0)`` splits tensor dim 0 over some mesh axis). An axis's
**degree** is its number of ranks. A mesh axis is never called a dim here.

Rank layout (Megatron-Core's order, tp-cp-dp-pp): ranks are numbered row-major over the base
axes ``BASE_AXES`` = (pp, dp, cp, tp), tensor parallelism fastest varying, so that a tensor-
parallel group is consecutive ranks inside a node::

    rank = ((pp_index * dp + dp_index) * cp + cp_index) * tp + tp_index

The dp axis may be split into two sub-axes, outer x inner, its index being
``outer_index * inner + inner_index``:

- HSDP (``dp_shard`` set): dp_replicate x dp_shard, a parameter shard group is ``dp_shard``
  consecutive dp ranks;
- expert parallelism (``ep > 1``): edp x ep, an expert-parallel group is ``ep`` consecutive dp
  ranks, and edp holds the ranks with the same experts.

The layout's finest axes (``ParallelDims.layout``) are pp, dp's sub-axes, cp, tp, in that
order: the order ``init_device_mesh`` numbers its ranks in (``torch.arange(world).reshape(
mesh_shape)``), so a group computed here is the group DeviceMesh makes. Where dp is not split,
``dp_shard`` and ``edp`` span all of dp (ZeRO shards over all of it; every rank holds the same
experts) and ``dp_replicate`` and ``ep`` span no axis (a group of one rank).

A group on several axes (``ParallelDims.group(axes, rank)``) holds the ranks that differ from
``rank`` only on those axes, in rank order: the gradient-averaging group is
``(DP, CP)``, a pipeline stage's ranks ``(DP, CP, TP)``.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from autoplan.errors import ConfigError


class MeshAxis(enum.StrEnum):
    """A device-mesh axis; its value is the name plan files and DeviceMeshes use."""

    PP = "pp"                       # pipeline stages
    DP = "dp"                       # data parallel (the whole dp axis)
    DP_REPLICATE = "dp_replicate"   # HSDP: outer dp sub-axis, replicas of one shard
    DP_SHARD = "dp_shard"           # HSDP: inner dp sub-axis, one parameter shard group
    EDP = "edp"                     # expert parallelism: outer dp sub-axis, same experts
    EP = "ep"                       # expert parallelism: inner dp sub-axis, experts split
    CP = "cp"                       # context parallel: the sequence split
    TP = "tp"                       # tensor parallel: weights split

    @property
    def carries(self) -> frozenset[Load]:
        """What this axis may carry (``CARRIES``)."""
        return CARRIES[self]


class Load(enum.StrEnum):
    """What a mesh axis may split or spread over its ranks."""

    BATCH = "batch"                 # different samples per rank
    SEQUENCE = "sequence"           # one sample's sequence split over the ranks
    WEIGHT_SPLITS = "weight splits"  # weights split on a tensor dim (a per-op strategy)
    MODEL_STATE = "model state"     # ZeRO/FSDP shards of weights, gradients, optimizer state
    EXPERTS = "experts"             # expert weights split on their expert dim, tokens routed
    STAGES = "stages"               # consecutive model chunks (pipeline parallelism)


_B, _S, _W, _M, _E, _P = (Load.BATCH, Load.SEQUENCE, Load.WEIGHT_SPLITS, Load.MODEL_STATE,
                          Load.EXPERTS, Load.STAGES)
# what each axis may carry: the planner's search space on it
CARRIES: Mapping[MeshAxis, frozenset[Load]] = {
    MeshAxis.PP: frozenset({_P}),
    MeshAxis.DP: frozenset({_B, _M}),
    MeshAxis.DP_REPLICATE: frozenset({_B}),             # replicas: gradients all-reduced
    MeshAxis.DP_SHARD: frozenset({_B, _M}),
    MeshAxis.EDP: frozenset({_B, _M}),                  # FSDP shards the experts over it
    MeshAxis.EP: frozenset({_B, _E, _M}),
    MeshAxis.CP: frozenset({_S, _M}),                   # ZeRO shards over dp x cp
    MeshAxis.TP: frozenset({_W, _S}),                   # sequence parallel, ring attention
}

BASE_AXES = (MeshAxis.PP, MeshAxis.DP, MeshAxis.CP, MeshAxis.TP)   # the layout, outermost first
# the sub-axes dp splits into (outer, inner), and the ParallelDims degree naming the inner one
DP_SPLITS = {MeshAxis.DP_SHARD: (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD),
             MeshAxis.EP: (MeshAxis.EDP, MeshAxis.EP)}
# the axes of one pipeline stage: its ranks are a group on them
STAGE_AXES = (MeshAxis.DP, MeshAxis.CP, MeshAxis.TP)
# base axes a DeviceMesh names only when they have more than one rank (plans written without
# them keep their files); dp (or its sub-axes) and tp are always named
OPTIONAL_MESH_AXES = frozenset({MeshAxis.PP, MeshAxis.CP})

Axes = MeshAxis | Iterable[MeshAxis]


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees of the mesh axes and everything derived from them: the rank layout, the
    group of a rank on any set of axes, the DeviceMesh's shape and axis names.

    ``dp_shard``: HSDP's shard group size (dp splits into dp_replicate x dp_shard), None when
    ZeRO shards over all of dp; ``ep``: the expert-parallel degree (dp splits into edp x ep
    when above 1). At most one of them splits dp.
    """

    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    dp_shard: int | None = None
    ep: int = 1
    world_size: int = field(init=False, repr=False, compare=False)   # the product of the degrees

    def __post_init__(self) -> None:
        for axis in BASE_AXES:
            v = getattr(self, axis.value)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{axis.value} must be a positive integer, got {v!r}")
        if not isinstance(self.ep, int) or self.ep < 1 or self.dp % self.ep:
            raise ConfigError(f"ep={self.ep!r} must be a positive integer dividing "
                              f"dp={self.dp}: expert-parallel groups are made of dp ranks")
        if self.dp_shard is not None:
            if not isinstance(self.dp_shard, int) or not 1 < self.dp_shard < self.dp \
                    or self.dp % self.dp_shard:
                raise ConfigError(f"dp_shard must divide dp={self.dp} and lie strictly "
                                  f"between 1 and dp (None shards over all of dp), got "
                                  f"{self.dp_shard!r}")
            if self.ep > 1:
                raise ConfigError(f"dp splits one way at a time: dp_shard={self.dp_shard} "
                                  f"(HSDP) and ep={self.ep} both split it; drop one")
        # what is derived from the degrees, computed once per key (the search asks for the
        # same groups of thousands of ranks many times); not a field: equality and hashing
        # see the degrees only
        object.__setattr__(self, "_memo", {})
        object.__setattr__(self, "world_size",
                           math.prod(getattr(self, a.value) for a in BASE_AXES))

    @staticmethod
    def of(*, pp: int = 1, dp: int = 1, cp: int = 1, tp: int = 1, dp_shard: int | None = None,
           ep: int = 1) -> ParallelDims:
        """The ParallelDims of these degrees, one shared value per set of degrees (so that
        what it derives is derived once)."""
        return _interned(pp, dp, cp, tp, dp_shard, ep)

    # ---- degrees and the layout ---------------------------------------------------------------
    @property
    def dp_split(self) -> tuple[MeshAxis, MeshAxis] | None:
        """The (outer, inner) sub-axes dp is split into, or None."""
        if self.dp_shard is not None:
            return DP_SPLITS[MeshAxis.DP_SHARD]
        if self.ep > 1:
            return DP_SPLITS[MeshAxis.EP]
        return None

    def degree(self, axes: Axes) -> int:
        """How many ranks a group on ``axes`` holds."""
        strides = self._strides()
        return math.prod(strides[a][0] for a in self.fine(axes))

    @property
    def layout(self) -> tuple[tuple[MeshAxis, int], ...]:
        """The finest axes and their degrees, outermost first (rank = row-major index)."""
        memo = self._memo
        if "layout" not in memo:
            memo["layout"] = _layout(self)
        return memo["layout"]

    def fine(self, axes: Axes) -> tuple[MeshAxis, ...]:
        """The layout axes ``axes`` span, in layout order (one axis may span none, one or
        two: dp spans its sub-axes, ep none where dp is not split)."""
        key = ("fine", axes)
        memo = self._memo
        try:
            return memo[key]
        except KeyError:
            found = memo[key] = _fine(self, _as_tuple(axes))
            return found
        except TypeError:                   # axes given as an unhashable iterable
            return _fine(self, _as_tuple(axes))

    # ---- the device mesh ----------------------------------------------------------------------
    def mesh_axes(self) -> tuple[MeshAxis, ...]:
        """The DeviceMesh's axes (the plan file's ``mesh.axes``), outermost first: the layout
        without the optional base axes of one rank."""
        memo = self._memo
        if "mesh" not in memo:
            memo["mesh"] = tuple(a for a, n in self.layout
                                 if n > 1 or a not in OPTIONAL_MESH_AXES)
        return memo["mesh"]

    def mesh_names(self) -> tuple[str, ...]:
        """``mesh_axes`` as plain names, for ``init_device_mesh(mesh_dim_names=...)``."""
        return tuple(a.value for a in self.mesh_axes())

    def mesh_shape(self) -> tuple[int, ...]:
        sizes = dict(self.layout)
        return tuple(sizes[a] for a in self.mesh_axes())

    def flat_name(self, axes: Axes) -> str:
        """The name of the DeviceMesh axis flattened from ``axes`` (torchtitan's names): dp's
        sub-axes together read ``dp``, then the others joined by ``_`` (``dp_cp``,
        ``dp_shard_cp``)."""
        fine = self.fine(axes)
        split = self.dp_split
        names = [a.value for a in fine]
        if split is not None and all(s in fine for s in split):
            at = fine.index(split[0])
            names[at:at + 2] = [MeshAxis.DP.value]
        return "_".join(names)

    def data_axes(self) -> tuple[MeshAxis, ...]:
        """The mesh axes whose ranks see different data and average gradients: dp (its
        sub-axes) and cp where the mesh has it."""
        memo = self._memo
        if "data" not in memo:
            memo["data"] = self._in_mesh((MeshAxis.DP, MeshAxis.CP))
        return memo["data"]

    def fsdp_axes(self) -> tuple[tuple[MeshAxis, ...], ...]:
        """The mesh FSDP2 shards over, one tuple of layout axes per (flattened) mesh axis:
        under HSDP (replicate, shard x cp), else the data axes as one."""
        if self.dp_shard is not None:
            return ((MeshAxis.DP_REPLICATE,), self._in_mesh((MeshAxis.DP_SHARD, MeshAxis.CP)))
        return (self.data_axes(),)

    def _in_mesh(self, axes: Axes) -> tuple[MeshAxis, ...]:
        mesh = self.mesh_axes()
        return tuple(a for a in self.fine(axes) if a in mesh)

    # ---- ranks and groups ---------------------------------------------------------------------
    def coords(self, rank: int) -> dict[MeshAxis, int]:
        """``rank``'s index on every axis (on dp's sub-axes too; 0 where an axis spans none)."""
        return {a: self.index(rank, a) for a in MeshAxis}

    def index(self, rank: int, axes: Axes) -> int:
        """``rank``'s index in its group on ``axes`` (row-major over their layout axes)."""
        self._check_rank(rank)
        out = 0
        for a in self.fine(axes):
            n, stride = self._strides()[a]
            out = out * n + rank // stride % n
        return out

    def rank_at(self, at: Mapping[MeshAxis, int]) -> int:
        """The rank at index ``at[a]`` on each axis given (0 on the others); the axes given
        must span different layout axes."""
        key = ("at", tuple(at.items()))
        if key in self._memo:
            return self._memo[key]
        strides = self._strides()
        seen: set[MeshAxis] = set()
        rank = 0
        for axis, i in at.items():
            fine = self.fine(axis)
            if seen & set(fine):
                raise ValueError(f"axes {[a.value for a in at]} overlap on the layout axes "
                                 f"{[a.value for a in seen & set(fine)]}")
            seen |= set(fine)
            if not 0 <= i < self.degree(axis):
                raise ValueError(f"index {i} on axis {axis.value} of degree "
                                 f"{self.degree(axis)}")
            for a in reversed(fine):
                n, stride = strides[a]
                i, k = divmod(i, n)
                rank += k * stride
        self._memo[key] = rank
        return rank

    def group(self, axes: Axes, rank: int = 0) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only on ``axes``, ascending (``rank``'s group
        on those axes)."""
        fine = self.fine(axes)
        key = ("group", fine, rank)
        memo = self._memo
        if key not in memo:
            self._check_rank(rank)
            memo[key] = _group(self, fine, rank)
        return memo[key]

    def groups(self, axes: Axes) -> tuple[tuple[int, ...], ...]:
        """Every group on ``axes``, ordered by their first rank: a partition of the world."""
        fine = self.fine(axes)
        firsts = _group(self, tuple(a for a, _ in self.layout if a not in fine), 0)
        return tuple(self.group(fine, r) for r in firsts)

    def describe(self) -> str:
        """``pp2 x dp4 x tp2`` for messages: the base axes, the optional ones where they have
        several ranks (pp always, as messages have named it)."""
        return " x ".join(f"{a.value}{getattr(self, a.value)}" for a in BASE_AXES
                          if a is MeshAxis.PP or a not in OPTIONAL_MESH_AXES
                          or getattr(self, a.value) > 1)

    def _strides(self) -> dict[MeshAxis, tuple[int, int]]:
        """Layout axis -> (degree, stride in ranks)."""
        memo = self._memo
        if "strides" not in memo:
            out = {}
            stride = 1
            for axis, n in reversed(self.layout):
                out[axis] = (n, stride)
                stride *= n
            memo["strides"] = out
        return memo["strides"]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside the world of {self.world_size} ranks")


def _as_tuple(axes: Axes) -> tuple[MeshAxis, ...]:
    return (axes,) if isinstance(axes, MeshAxis) else tuple(axes)


@lru_cache(maxsize=1024)
def _interned(pp: int, dp: int, cp: int, tp: int, dp_shard: int | None, ep: int
              ) -> ParallelDims:
    return ParallelDims(pp=pp, dp=dp, cp=cp, tp=tp, dp_shard=dp_shard, ep=ep)


def _layout(dims: ParallelDims) -> tuple[tuple[MeshAxis, int], ...]:
    out: list[tuple[MeshAxis, int]] = []
    for axis in BASE_AXES:
        split = dims.dp_split if axis is MeshAxis.DP else None
        if split is None:
            out.append((axis, getattr(dims, axis.value)))
        else:
            inner = dims.dp_shard if split[1] is MeshAxis.DP_SHARD else dims.ep
            out += [(split[0], dims.dp // inner), (split[1], inner)]
    return tuple(out)


def _fine(dims: ParallelDims, axes: tuple[MeshAxis, ...]) -> tuple[MeshAxis, ...]:
    present = [a for a, _ in dims.layout]
    split = dims.dp_split
    dp = tuple(split) if split is not None else (MeshAxis.DP,)
    want: set[MeshAxis] = set()
    for axis in axes:
        if axis in present:
            want.add(axis)
        elif axis is MeshAxis.DP:
            want.update(dp)
        elif axis in (MeshAxis.DP_SHARD, MeshAxis.EDP):     # unsplit: all of dp
            want.update(dp)
        elif axis in (MeshAxis.DP_REPLICATE, MeshAxis.EP):  # unsplit: no axis
            pass
        else:
            raise ValueError(f"{axis!r} is not a mesh axis")
    return tuple(a for a in present if a in want)


def _group(dims: ParallelDims, fine: tuple[MeshAxis, ...], rank: int) -> tuple[int, ...]:
    strides = dims._strides()
    base = rank - sum(rank // strides[a][1] % strides[a][0] * strides[a][1] for a in fine)
    steps = [[k * strides[a][1] for k in range(strides[a][0])] for a in fine]
    return tuple(base + sum(c) for c in itertools.product(*steps))
