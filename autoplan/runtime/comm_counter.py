"""Count the collectives a training step really issues (kind, calls, bytes), at run time.

A ``TorchDispatchMode`` sees every collective on its way to the process group: the c10d ops
that DDP, FSDP2 and ``torch.distributed`` calls go through, and the functional collectives
DTensor uses. Bytes follow the cost model's convention (``Cluster.collective_time_s``): the full
tensor for all-reduce and broadcast, the gathered output for all-gather, the unreduced input for
reduce-scatter, what one rank sends for all-to-all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _bytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(t) for t in x)
    return 0


# op name -> (kind, which argument holds the tensor(s) that set the bytes, multiply by arg)
_RULES: dict[str, tuple[str, int, int | None]] = {
    "c10d.allreduce_": ("all_reduce", 0, None),
    "c10d.allreduce_coalesced_": ("all_reduce", 0, None),
    "c10d._allgather_base_": ("all_gather", 0, None),
    "c10d.allgather_": ("all_gather", 0, None),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0, None),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1, None),
    "c10d.reduce_scatter_": ("reduce_scatter", 1, None),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, None),
    "c10d.broadcast_": ("broadcast", 0, None),
    "c10d.alltoall_": ("all_to_all", 1, None),
    "c10d.alltoall_base_": ("all_to_all", 1, None),
    "_c10d_functional.all_reduce": ("all_reduce", 0, None),
    "_c10d_functional.all_reduce_": ("all_reduce", 0, None),
    "_c10d_functional.all_reduce_coalesced_": ("all_reduce", 0, None),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", 0, None),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0, 1),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", 0, 1),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0, None),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, None),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0, None),
    "_c10d_functional.broadcast": ("broadcast", 0, None),
}


class CommCounter(TorchDispatchMode):
    """``with CommCounter() as c: trainer.step(batch)``; then ``c.counts[kind] = [calls, bytes]``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, list[float]] = {}

    def __torch_dispatch__(self, func, types, args: Sequence[Any] = (), kwargs=None):
        rule = _RULES.get(str(func.overloadpacket))
        if rule is not None:
            kind, arg, mult_arg = rule
            nbytes = _bytes(args[arg]) if arg < len(args) else 0
            if mult_arg is not None and mult_arg < len(args) and isinstance(args[mult_arg], int):
                nbytes *= args[mult_arg]
            entry = self.counts.setdefault(kind, [0, 0.0])
            entry[0] += 1
            entry[1] += nbytes
        return func(*args, **(kwargs or {}))
