"""``SearchOptions``: what ``plan``'s search may choose from. Its own module because every part
of the search reads it (``search``, ``search_space``, ``search_costing``, ``finalists``) and
``search`` imports those parts: here no part imports the whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What the search may choose from. ``force`` pins ParallelConfig fields (e.g.
    ``{"tp": 2, "zero_stage": 3}``); everything else is searched."""

    micro_batch_sizes: tuple[int, ...] | None = None   # default: powers of two up to 64
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = ("none", "selective", "full")
    offload_optimizer: tuple[bool, ...] = (False, True)
    offload_activations: bool = True     # offer activation offload (search_space.py)
    max_tp: int | None = None
    max_pp: int | None = None    # pipeline degrees up to this (None: up to the layer count)
    # the meshes searched, as (pp, dp, cp, tp) degrees (None: every mesh force allows): an
    # elastic re-plan's neighbourhood of the last plan's mesh (``replan.py``), searched in one
    # call so that its meshes share the tp-axis shardings and the floor of the best found
    meshes: tuple[tuple[int, int, int, int], ...] | None = None
    force: dict[str, Any] = field(default_factory=dict)
    top_k: int = 5
    # the baselines (pure DP, FSDP, Megatron-style, context parallel) costed beside the search,
    # so the plan is never predicted slower than them, and listed as alternatives. A search
    # whose force pins the layout cannot choose those that differ: an elastic re-plan's warm
    # start (``replan.py``) skips them (half its time on Llama-3-8B)
    baselines: bool = True
    ilp_time_limit_s: float = 20.0
    sharding: str = "ilp"        # "ilp", "megatron" (Megatron-LM's rule, for comparisons) or
                                 # "context" (the sequence split everywhere: ring attention)
    fixed_sharding: Any = None   # a Sharding to use on its tp degree (``autoplan verify``)
    memory_margin_bytes: float | None = None
    expert_capacity_factor: float = 1.0   # MoE routing imbalance priced (estimate() doc)
    pin: dict[str, str] = field(default_factory=dict)   # op pattern -> strategy (pins.py)
    # lossy options (PowerSGD gradient compression, low-bit optimizer states) are searched only
    # when the user allows them (``autoplan plan --allow-lossy``); forcing one works regardless
    allow_lossy: bool = False
    # precision="auto": the search also tries fp32 where 16 bits gain nothing, and fp8 linear
    # layers (tensorwise, rowwise) where the device has fp8 (``search_space.precision_variants``)
    precision_auto: bool = False
    # how 16-bit plans hold their weights (search_space.mixed_precision_choices): autocast
    # alone unless the user offers "params" (other numerics: norms and softmax in 16 bits);
    # precision_auto offers it too
    mixed_precision: tuple[str, ...] = ("autocast",)
    # what the plan is best at (planner/objectives.py): "time" (the fastest step), "cost"
    # (the cheapest run, at list prices) or "energy"; with any of these objective options the
    # search also chooses how many of the cluster's devices to use (up to max_gpus), and the
    # plan records the Pareto front over time, cost and energy. tokens: the run's length
    # (run time = tokens / tokens per second); deadline_days and budget_usd bound the run.
    objective: str = "time"
    max_gpus: int | None = None
    budget_usd: float | None = None
    tokens: int | None = None
    deadline_days: float | None = None
    # prices and power over cost_models/economics.yaml and the cluster file's (keys:
    # usd_per_gpu_hour, tdp_watt, compute_fraction, communication_fraction, idle_fraction)
    economics: dict[str, float] = field(default_factory=dict)
    # the data's document lengths (``--seq-lengths``: a file path, a LengthHistogram, or the
    # PackedWork ``plan`` makes of either): documents packed into the traced sequence length
    # behind a document mask, attention priced at its expected masked work (sharding/doc_work)
    seq_lengths: Any = None
