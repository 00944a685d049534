"""The arguments ``estimate``, ``plan`` and ``compile`` share, checked once with errors that say
the fix (a user's mistake gets a ConfigError, never an AttributeError from deep inside).

Two sizes are bounded, so that no argument can make planning run for hours:

- the global batch, at ``MAX_GLOBAL_BATCH`` = 2^24 = 16,777,216 samples: 256 times the largest
  published global batch we know of (LAMB's 65,536 BERT sequences, You et al. 2020), and far
  below where Python's integers stop converting to floats (a 400-digit batch overflowed);
- the micro-batches of one pipelined step, at ``MAX_PIPELINE_MICROBATCHES`` = 4,096. The
  pipeline simulator steps through every (micro-batch, chunk, forward/backward) action, about
  13 us each on this project's CPU: a 16-stage, 4-chunk step of 4,096 micro-batches takes 7 s
  to simulate, and the planner simulates up to a dozen finalists. Published pipelined runs use
  a few hundred (Megatron-LM's 1T-parameter run: 3,072 samples over dp 6, 512 of size 1). A
  global batch of 10^12 on 4 ranks asked the simulator for 1.6 x 10^10 micro-batches: it hung.
  Data-parallel-only configurations are priced in closed form and take any count.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields
from typing import Any

from autoplan.cluster import Cluster
from autoplan.errors import AutoplanError, ConfigError
from autoplan.cluster.profile_db import ProfileDB
from autoplan.sharding.sharding import Sharding
from autoplan.sharding.parallel_config import ParallelConfig, RECOMPUTE

MAX_GLOBAL_BATCH = 1 << 24
MAX_PIPELINE_MICROBATCHES = 4096


def cluster_arg(cluster: Any, who: str) -> Cluster:
    """A Cluster, or a spec string (``"dgx-h100:4"``, ``"local:2"``, a file path)."""
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, str):
        return Cluster.from_spec(cluster)
    raise ConfigError(f"{who}: cluster must be an autoplan.Cluster or a spec such as "
                      f"'dgx-h100:4' or 'local:2', got {type(cluster).__name__} {cluster!r:.60}")


def batch_arg(global_batch_size: Any, who: str) -> int:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) \
            or global_batch_size < 1:
        raise ConfigError(f"{who}: global_batch_size must be a positive integer (samples per "
                          f"step), got {global_batch_size!r:.60}")
    if global_batch_size > MAX_GLOBAL_BATCH:
        raise ConfigError(f"{who}: a global batch of {_count(global_batch_size)} samples is "
                          f"beyond what autoplan plans (at most {MAX_GLOBAL_BATCH:,} = 2^24, "
                          "256 times the largest published ones); global_batch_size counts "
                          "samples (sequences, images) per step, not tokens")
    return global_batch_size


def microbatches_arg(m: int, config: Any) -> int:
    """The micro-batch count of one step, refused above ``MAX_PIPELINE_MICROBATCHES`` for a
    pipelined config (the simulator steps through each; see the module doc)."""
    if config.pp > 1 and m > MAX_PIPELINE_MICROBATCHES:
        raise ConfigError(f"{_count(m)} micro-batches per step (global batch / dp {config.dp} / "
                          f"micro_batch_size {config.micro_batch_size}) over pp={config.pp}: "
                          f"autoplan simulates pipelined steps of at most "
                          f"{MAX_PIPELINE_MICROBATCHES:,} micro-batches; raise "
                          "micro_batch_size or dp, or lower the global batch")
    return m


def _count(n: int) -> str:
    text = str(n)
    return f"{n:,}" if len(text) <= 24 else f"a {len(text)}-digit number of"


def capacity_arg(factor: Any) -> float:
    """An expert capacity factor, checked: a number >= 1."""
    try:
        value = float("nan") if isinstance(factor, bool) else float(factor)
    except (TypeError, ValueError):
        value = float("nan")
    if not value >= 1.0 or value == float("inf"):
        raise ConfigError(f"expert_capacity_factor must be a number >= 1 (1: balanced routing; "
                          f"Switch Transformer and Megatron-LM use 1.0 to 2.0), got {factor!r}")
    return value


def profile_arg(profile: Any, cluster: Cluster, who: str) -> Any:
    """A ProfileDB, None (roofline only), "auto" (the installed profile of the cluster's device)
    or a path to a profile file."""
    if profile is None or isinstance(profile, ProfileDB):
        return profile
    if profile == "auto":
        return ProfileDB.find(cluster.device.name)
    if isinstance(profile, str) and profile.endswith(".json"):
        return ProfileDB.load(profile)
    raise ConfigError(f"{who}: profile must be a ProfileDB, None (roofline only), 'auto' (the "
                      "installed profile of the cluster's device) or a .json profile path, got "
                      f"{profile!r:.60}")


def options_error(e: TypeError, who: str, allowed: list[str]) -> AutoplanError:
    """A ConfigError for an unknown keyword argument."""
    return ConfigError(f"{who}: {e}; the options are {', '.join(sorted(allowed))}")


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def margin_arg(margin: Any, who: str) -> float | None:
    """``memory_margin_bytes``: None (the cluster's default) or a finite number >= 0."""
    if margin is None:
        return None
    if not _number(margin) or margin < 0:
        raise ConfigError(f"{who}: memory_margin_bytes must be None (the cluster's default "
                          f"headroom) or a number of bytes >= 0, got {margin!r:.60}")
    return float(margin)


def estimate_options_arg(*, memory_margin_bytes: Any, sharding: Any, simulate_pipeline: Any,
                         who: str = "estimate()") -> None:
    """``estimate``'s keyword options other than the model, the cluster and the batch."""
    margin_arg(memory_margin_bytes, who)
    if sharding is not None and not isinstance(sharding, Sharding):
        raise ConfigError(f"{who}: sharding must be None (Megatron-LM's rule for config.tp) or "
                          f"a Sharding from the planner (plan.sharding), got "
                          f"{type(sharding).__name__} {sharding!r:.40}")
    if not isinstance(simulate_pipeline, bool):
        raise ConfigError(f"{who}: simulate_pipeline must be True (simulate the schedule) or "
                          f"False (its closed form), got {simulate_pipeline!r:.40}")


def config_fields() -> list[str]:
    """The ParallelConfig fields ``force`` may pin, in declaration order."""
    return [f.name for f in fields(ParallelConfig)]


def force_arg(force: Any, who: str) -> dict:
    """``force``: a dict of ParallelConfig fields to pin, each of its field's type. Unknown
    fields are refused listing the valid ones (with the nearest name when one is close)."""
    import difflib

    if not isinstance(force, dict):
        raise ConfigError(f"{who}: force must be a dict of ParallelConfig fields, e.g. "
                          f"{{'tp': 2, 'zero_stage': 3}}, got {force!r:.60}")
    types = {f.name: str(f.type) for f in fields(ParallelConfig)}
    for key, value in force.items():
        if not isinstance(key, str) or key not in types:
            near = difflib.get_close_matches(str(key).lower(), list(types), n=1)
            raise ConfigError(f"{who}: force names no ParallelConfig field {key!r}"
                              + (f" (did you mean {near[0]!r}?)" if near else "")
                              + f"; the fields are {', '.join(types)}")
        want = _field_kind(types[key])
        if want and not _is_kind(value, want):
            raise ConfigError(f"{who}: force {key}={value!r:.40} must be {want} (the type of "
                              f"ParallelConfig.{key}: {types[key]})")
        least = 0 if key in ("zero_stage", "offload_activations") else 1
        if want == "an integer" and value < least or key == "zero_stage" and value > 3:
            raise ConfigError(f"{who}: force {key}={value} is out of range: "
                              + ("ZeRO stages are 0 to 3" if key == "zero_stage"
                                 else f"{key} is a count >= 1"))
    return force


def _field_kind(annotation: str) -> str:
    text = annotation.replace(" ", "")
    optional = "|None" in text
    base = text.replace("|None", "")
    kind = {"int": "an integer", "bool": "True or False", "str": "a string",
            "tuple[int,...]": "a list of integers",
            "tuple[str,...]": "a list of strings",
            "tuple[bool,...]": "a list of True/False values"}.get(base, "")
    return f"{kind} or None" if kind and optional else kind


def _is_kind(value: Any, kind: str) -> bool:
    if value is None:
        return kind.endswith("or None")
    if kind.startswith("an integer"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind.startswith("True or False"):
        return isinstance(value, bool)
    if kind.startswith("a string"):
        return isinstance(value, str)
    if kind.startswith("a list of True/False"):
        return isinstance(value, (tuple, list)) and all(isinstance(x, bool) for x in value)
    item = int if kind.startswith("a list of integers") else str
    if isinstance(value, str):                 # dp_whole takes one pattern too
        return item is str
    return isinstance(value, (tuple, list)) and all(
        isinstance(x, item) and not isinstance(x, bool) for x in value)


def search_options_arg(opts: Any, *, progress: Any, who: str = "plan()") -> None:
    """``plan``'s search options (``SearchOptions`` fields) and its ``progress`` callback."""

    def refuse(name: str, want: str) -> None:
        raise ConfigError(f"{who}: {name} must be {want}, got {getattr(opts, name)!r:.60}")

    def choices(name: str, allowed: tuple, what: str) -> None:
        v = getattr(opts, name)
        flags = all(isinstance(a, bool) for a in allowed)
        if not isinstance(v, (tuple, list)) or not v or any(
                isinstance(x, bool) != flags or x not in allowed for x in v):
            refuse(name, f"a non-empty list of {what} from {list(allowed)}")

    if isinstance(opts.top_k, bool) or not isinstance(opts.top_k, int) or opts.top_k < 0:
        refuse("top_k", "an integer >= 0 (alternatives kept in the plan)")
    for name in ("max_tp", "max_pp"):
        if getattr(opts, name) is not None and not _positive_int(getattr(opts, name)):
            refuse(name, "None (no limit) or a positive integer")
    mbs = opts.micro_batch_sizes
    if mbs is not None and (not isinstance(mbs, (tuple, list)) or not mbs or not all(
            _positive_int(m) and m <= MAX_GLOBAL_BATCH for m in mbs)):
        refuse("micro_batch_sizes", "None (powers of two up to 64) or a non-empty list of "
               "positive integers")
    choices("zero_stages", (0, 1, 2, 3), "ZeRO stages")
    choices("recompute", tuple(RECOMPUTE), "recompute policies")
    choices("offload_optimizer", (False, True), "booleans")
    if not isinstance(opts.allow_lossy, bool):
        refuse("allow_lossy", "True or False (whether lossy options may be searched)")
    if not isinstance(opts.baselines, bool):
        refuse("baselines", "True (cost the baselines beside the search) or False")
    if not isinstance(opts.offload_activations, bool):
        refuse("offload_activations", "True (offer activation offload) or False")
    if not _number(opts.ilp_time_limit_s) or opts.ilp_time_limit_s <= 0:
        refuse("ilp_time_limit_s", "a positive, finite number of seconds (every solve has a "
               "time limit)")
    margin_arg(opts.memory_margin_bytes, who)
    force_arg(opts.force, who)
    if opts.fixed_sharding is not None and not isinstance(opts.fixed_sharding, Sharding):
        refuse("fixed_sharding", "None or a Sharding (plan.sharding)")
    if progress is not None and not callable(progress):
        raise ConfigError(f"{who}: progress must be None or a function taking one message "
                          f"string (e.g. print), got {progress!r:.60}")


def path_arg(path: Any, *, who: str, what: str, error: type[AutoplanError],
             fix: str = "") -> str:
    """A file path given to an API function: a str or os.PathLike (bytes decoded), with no
    NUL character; anything else is refused saying what was given (and ``fix``)."""
    try:
        text = os.fsdecode(os.fspath(path))
    except (TypeError, ValueError, UnicodeError):
        raise error(f"{who}: {what} must be a path (a str or os.PathLike), got "
                    f"{type(path).__name__} {path!r:.60}" + (f"; {fix}" if fix else "")) from None
    if "\0" in text:
        raise error(f"{who}: the path {text!r:.60} holds a NUL character; no file has that name")
    return text
