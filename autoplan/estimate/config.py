"""ParallelConfig: one point of the search space, as a user writes it or the planner picks it.

Rank layout (recorded, and assumed by the cost model): tensor-parallel ranks are consecutive
(fastest varying, so a TP group sits inside a node), then data parallel, then pipeline stages:
``rank = pp_index * (dp * tp) + dp_index * tp + tp_index`` (the Megatron-LM order).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from autoplan.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zero_bubble")   # may take virtual_stages > 1
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees and policies of one training configuration.

    ``num_microbatches`` may be left ``None``: it is derived from the global batch as
    ``global_batch_size / (dp * micro_batch_size)``. ``virtual_stages`` is the number of model
    chunks per pipeline rank (with ``interleaved_1f1b`` or ``zero_bubble``). ``zero_bubble``
    splits each backward into its input-gradient and weight-gradient halves and runs the latter
    in the bubbles (Qi et al. 2024, ZB-H1 over interleaved chunks; torch's
    ``ScheduleInterleavedZeroBubble``).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch_size: int = 1
    num_microbatches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    offload_optimizer: bool = False
    offload_params: bool = False          # weights and gradients in host memory (ZeRO-3 only)
    precision: str = "bf16"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch_size", "virtual_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.num_microbatches is not None and (
                not isinstance(self.num_microbatches, int) or self.num_microbatches < 1):
            raise ConfigError(f"num_microbatches must be a positive integer or None, "
                              f"got {self.num_microbatches!r}")
        _one_of("schedule", self.schedule, SCHEDULES)
        _one_of("recompute", self.recompute, RECOMPUTE)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.virtual_stages > 1 and self.schedule not in MULTI_CHUNK_SCHEDULES:
            raise ConfigError(f"virtual_stages={self.virtual_stages} needs schedule "
                              f"'interleaved_1f1b' or 'zero_bubble' (got {self.schedule!r})")
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError("offload_params=True needs zero_stage=3: the weights are offloaded "
                              "as FSDP shards and gathered to the device layer by layer")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("sequence_parallel=True needs tp > 1 (it shards the "
                              "activations that tensor parallelism leaves replicated)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def microbatches(self, global_batch_size: int) -> int:
        """Micro-batches per step per pipeline; raises ConfigError if the batch does not divide."""
        per_replica, rem = divmod(global_batch_size, self.dp)
        if rem:
            raise ConfigError(f"global batch {global_batch_size} does not divide into dp={self.dp} "
                              f"replicas; use a multiple of {self.dp}")
        m, rem = divmod(per_replica, self.micro_batch_size)
        if rem:
            raise ConfigError(f"the per-replica batch {per_replica} (= {global_batch_size} / dp "
                              f"{self.dp}) is not a multiple of micro_batch_size "
                              f"{self.micro_batch_size}; pick a micro-batch size dividing it")
        if self.num_microbatches is not None and self.num_microbatches != m:
            raise ConfigError(f"num_microbatches={self.num_microbatches} but global batch "
                              f"{global_batch_size} / (dp {self.dp} x micro_batch_size "
                              f"{self.micro_batch_size}) = {m}; drop num_microbatches or fix it")
        return m

    def rank(self, *, pp_index: int, dp_index: int, tp_index: int) -> int:
        return pp_index * (self.dp * self.tp) + dp_index * self.tp + tp_index

    def tp_group(self, pp_index: int = 0, dp_index: int = 0) -> tuple[int, ...]:
        return tuple(self.rank(pp_index=pp_index, dp_index=dp_index, tp_index=t)
                     for t in range(self.tp))

    def dp_group(self, pp_index: int = 0, tp_index: int = 0) -> tuple[int, ...]:
        return tuple(self.rank(pp_index=pp_index, dp_index=d, tp_index=tp_index)
                     for d in range(self.dp))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ParallelConfig:
        known = {f.name for f in fields(ParallelConfig)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown ParallelConfig keys {unknown}; known: {sorted(known)}")
        return ParallelConfig(**d)

    def short(self) -> str:
        s = f"dp{self.dp} tp{self.tp} pp{self.pp} mbs{self.micro_batch_size}"
        if self.pp > 1:
            s += f" {self.schedule}" + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else "")
        if self.zero_stage:
            s += f" zero{self.zero_stage}"
        if self.sequence_parallel:
            s += " sp"
        if self.recompute != "none":
            s += f" recompute={self.recompute}"
        if self.offload_optimizer:
            s += " offload-opt"
        if self.offload_params:
            s += " offload-params"
        return s + f" {self.precision}"


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
