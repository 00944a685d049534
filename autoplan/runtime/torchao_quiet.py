"""Importing torchao (optional: low-bit optimizer states, fp8 linears) without its import-time
log noise. torchao registers its Enum classes as pytree constants, which torch 2.12 and later
log as deprecated once per class and per process, a dozen lines on every rank of a run that
say nothing to a user. Only that logger is lowered, and only while the import runs."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

_PYTREE_LOGGER = "torch.utils._pytree"


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Wrap the first ``import torchao...`` of a process: torch's pytree deprecation notices
    are dropped for its duration (warnings of any other logger still show)."""
    log = logging.getLogger(_PYTREE_LOGGER)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
