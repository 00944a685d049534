"""Naming the rank that died.

When a rank dies, its peers see raw backend text ("Connection closed by peer
[10.0.0.3]:38834") that says neither which rank nor why. Each rank writes where it runs (host,
pid) and how far it got into the job's rendezvous store (which ``torchrun``'s agent hosts, so it
outlives the workers); a rank that dies of an uncaught Python exception also writes that. A
survivor whose collective fails reads them back and raises ``RankFailure`` naming the rank(s)
that stopped, their host, and the cause where one was written.
"""

from __future__ import annotations

import socket
import sys
from datetime import timedelta
from typing import Any

from autoplan.errors import AutoplanError

_PREFIX = "autoplan/health"


class RankFailure(AutoplanError):
    """A peer rank stopped (died or hung) during training."""


class Health:
    def __init__(self, store: Any, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world
        self._broken = False
        try:
            self._set("where", f"{socket.gethostname()} (pid {_pid()})")
        except Exception:        # noqa: BLE001 (best effort, as mark)
            self._broken = True
        self.mark("compiled")
        previous = sys.excepthook

        def hook(kind, value, tb):           # an uncaught exception: leave the cause behind
            try:
                self._set("failed", f"{kind.__name__}: {str(value).splitlines()[0][:300]}"
                          if str(value) else kind.__name__)
            except Exception:    # noqa: BLE001 (the store may be gone too)
                pass
            previous(kind, value, tb)
        sys.excepthook = hook

    def _set(self, what: str, value: str) -> None:
        self.store.set(f"{_PREFIX}/{what}/{self.rank}", value)

    def _get(self, what: str, rank: int) -> str | None:
        key = f"{_PREFIX}/{what}/{rank}"
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode(errors="replace")
        except Exception:        # noqa: BLE001 (the store itself may have died)
            return None

    def mark(self, status: str) -> None:
        """Record how far this rank got. Best effort: the records only serve to name a dead
        peer, so a store that cannot take them (a reset connection on a loaded machine) never
        fails training; the job's own collectives report a real failure."""
        if self._broken:
            return
        try:
            self._set("status", status)
        except Exception:        # noqa: BLE001
            self._broken = True

    def fail(self, status: str, error: BaseException) -> RankFailure:
        """The error a survivor raises: which ranks stopped, where, why (as far as known)."""
        try:
            self.store.set_timeout(timedelta(seconds=5))
        except Exception:        # noqa: BLE001
            pass
        lines = []
        for r in range(self.world):
            if r == self.rank:
                continue
            where = self._get("where", r)
            if where is None:
                lines.append(f"rank {r}: unreachable (the rendezvous store is gone; it ran on "
                             "rank 0's host)" if r == 0 else f"rank {r}: no record")
                continue
            failed = self._get("failed", r)
            state = self._get("status", r)
            if failed is not None:
                lines.append(f"rank {r} on {where} died: {failed}")
            elif state != status:
                lines.append(f"rank {r} on {where} stopped after '{state}' (killed, out of "
                             "memory, or hung)")
        who = "; ".join(lines) or "no peer left a record (check the launcher's log)"
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else \
            type(error).__name__
        return RankFailure(f"rank {self.rank} on {socket.gethostname()} failed in '{status}' "
                           f"because a peer stopped: {who}. (Backend error: {first})")


def _pid() -> int:
    import os
    return os.getpid()


def for_job(rank: int, world: int) -> Health | None:
    """Health records in the default process group's store (None without one)."""
    import torch.distributed as dist
    if world < 2 or not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        return Health(_get_default_store(), rank, world)
    except Exception:            # noqa: BLE001 (a backend without a store: no records)
        return None
