"""Cluster descriptions: device/link/host specs, topology graphs and collective costs.

``Cluster.preset("dgx-a100-80gb", nodes=4)``, ``Cluster.from_file(path)``, ``Cluster.local()``;
data lives in ``cost_models/`` (devices.yaml, links.yaml, clusters.yaml) with a source for every
number. The measured figures of a device (``ProfileDB``, ``profile_db.py``) are read here too:
from ``profiles/`` and the profile cache. This layer sits below ``autoplan.cost`` and imports
nothing of it, nor of ``autoplan.machine``, which measures this machine.
"""

from autoplan.cluster.cluster import Cluster
from autoplan.cluster.collectives import COLLECTIVE_KINDS, CollectiveEstimate, GroupProfile, collective_bytes_per_rank
from autoplan.cluster.specs import DeviceSpec, HostSpec, LinkSpec

__all__ = [
    "COLLECTIVE_KINDS",
    "Cluster",
    "CollectiveEstimate",
    "DeviceSpec",
    "GroupProfile",
    "HostSpec",
    "LinkSpec",
    "collective_bytes_per_rank",
]
