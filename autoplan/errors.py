"""Exceptions raised by autoplan.

Every error says what is wrong, the values seen, and what to do about it. User input gets an
exception from this module, never an ``assert``.
"""

from __future__ import annotations


class AutoplanError(Exception):
    """Base class of every error autoplan raises on purpose."""


class TraceError(AutoplanError):
    """A model could not be traced into an OpGraph."""


class ClusterError(AutoplanError):
    """A cluster description (file, preset or arguments) is malformed."""


class ConfigError(AutoplanError):
    """A ParallelConfig does not fit the model, the cluster or the batch."""


class ProfileError(AutoplanError):
    """A profile database is malformed or cannot be written."""


class PlanError(AutoplanError):
    """A plan file is malformed, or does not match the model or cluster it is used with."""


class CheckpointError(AutoplanError):
    """A checkpoint is missing, incomplete, or does not fit the model or optimizer resuming it."""
