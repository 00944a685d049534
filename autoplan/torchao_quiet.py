"""Importing torchao (optional: low-bit optimizer states, fp8 linears) without its import-time
log noise. torchao registers its Enum classes as pytree constants, which torch 2.12 and later
log as deprecated once per class and per process, a dozen lines on every rank of a run that
say nothing to a user. Only that logger is lowered, and only while the import runs: the
runtime's own torchao imports, and building a model (Hugging Face ``transformers`` imports
torchao when it is installed)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

_PYTREE_LOGGER = "torch.utils._pytree"


@contextlib.contextmanager
def quiet_torchao_import() -> Iterator[None]:
    """Wrap the first ``import torchao...`` of a process: torch's pytree deprecation notices
    and torchao's own import-time warnings are dropped for its duration (warnings of any other
    logger still show)."""
    # torchao itself warns, on import, of each optional kernel library its build cannot load
    # (CUDA-only ones on a CPU build): autoplan uses none of them
    logs = [logging.getLogger(name) for name in (_PYTREE_LOGGER, "torchao")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)
