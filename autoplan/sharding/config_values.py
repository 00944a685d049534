"""The values each ParallelConfig field may take (its vocabulary: schedules, recomputation
policies, precisions, optimizers and their state, fp8 recipes, gradient compression), which
fields every plan file writes, and the check that a value is one of them. Read by
``parallel_config`` and ``config_rules`` (and, through ``parallel_config``, every layer above)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autoplan.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
# two chunks per rank placed in a V: rank r holds chunks r and 2p - 1 - r, so the first and
# the last chunk share rank 0 (Qi et al. 2024 Sec. 6; DeepSeek-V3's DualPipe, folded)
V_SCHEDULES = ("zbv", "dualpipev")
SPLIT_BACKWARD = ("zero_bubble", "zbv", "dualpipev")   # input and weight gradients apart
# least to most memory-saving. "ops": op-level selective checkpointing of a whole layer: the
# outputs of its products (matmuls, attention, convolutions: ``graph.oprules.OPS_POLICY_SAVES``)
# are kept, everything else (norms, element-wise ops, dropout) is recomputed in backward
# (torch.utils.checkpoint's selective checkpointing, as torchtitan's op-level SAC)
RECOMPUTE = ("none", "selective", "ops", "full")
PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adam", "sgd")
# how the optimizer holds Adam's two moments (``ParallelConfig.optimizer_state``)
OPTIMIZER_STATES = ("fp32", "bf16", "8bit")
# how 16-bit training holds its tensors (``cost/dtypes.py``, ``ParallelConfig.mixed_precision``)
MIXED_PRECISION = ("autocast", "params")
# how the dp all-reduce compresses gradients: "powersgd", torch's DDP communication hook (Vogels
# et al. 2019, ``powerSGD_hook``), lossy
GRAD_COMPRESSION = ("none", "powersgd")
# how a context-parallel axis lays the sequence out (``ParallelConfig.cp_layout``,
# ``sharding/ring_work.py``): contiguous pieces, or head-tail chunks that balance causal attention
CP_LAYOUTS = ("contiguous", "zigzag")
# torchao's float8 training recipes for the linear layers (``ParallelConfig.fp8``)
FP8_RECIPES = ("none", "tensorwise", "rowwise")


# the fields every plan file writes (the first schema's); ``ParallelConfig.to_dict`` writes each
# later one only where it is not its default
ALWAYS_WRITTEN = ("dp", "tp", "pp", "micro_batch_size", "num_microbatches", "schedule",
                  "virtual_stages", "zero_stage", "sequence_parallel", "recompute",
                  "offload_optimizer", "offload_params", "chunk_layers", "stage_recompute",
                  "precision", "optimizer")


def strongest_recompute(policies: Sequence[str]) -> str:
    """The most memory-saving of ``policies`` (``RECOMPUTE`` runs from least to most)."""
    return max(policies, key=lambda r: RECOMPUTE.index(r) if r in RECOMPUTE else -1)


def one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """ConfigError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")
