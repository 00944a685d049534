"""The arguments ``estimate``, ``plan`` and ``compile`` share, checked once with errors that say
the fix (a user's mistake gets a ConfigError, never an AttributeError from deep inside)."""

from __future__ import annotations

from typing import Any

from autoplan.cluster import Cluster
from autoplan.errors import AutoplanError, ConfigError


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
    return global_batch_size


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
    from autoplan.cost.profile_db import ProfileDB
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
