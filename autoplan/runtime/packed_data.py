"""`autoplan run` on packed documents: the data of a plan made for the data's document lengths
(``training.seq_lengths``, from ``plan --seq-lengths``), or of ``run --seq-lengths FILE``.

A plan for packed documents was traced with ``(tokens, position_ids)`` inputs (position ids
restarting at 0 in each document: the model builds its document mask from them,
``models/packing.py``), so the run feeds that form: the example's synthetic token rows, each
cut into documents drawn from the length histogram with seed 0 (``doc_work.pack_documents``,
the packing the planner priced), their position ids beside them. The traced example (one row)
is packed the same way, so that the run traces the graph the plan was made for. Every rank
builds the same rows; data, tensor, context and pipeline parallelism then split them as they
split any batch.

``--seq-lengths FILE`` at run time draws the documents from that file's lengths instead of the
plan's (the plan's histogram is binned, a file need not be); a plan made for unpacked
sequences cannot run on packed ones (its graph takes no position ids): it is refused with the
fix, as is a model whose forward takes no position ids.
"""

from __future__ import annotations

from typing import Any

from autoplan.errors import ConfigError
from autoplan.models.packing import document_ids, packed_example, refuse_unpackable
from autoplan.sharding.doc_work import pack_documents
from autoplan.sharding.seq_lengths import read_seq_lengths

DATA_SEED = 0          # the documents' draw: one seed, so every rank and every run packs alike


def run_histogram(plan: Any, seq_lengths_file: str | None) -> Any:
    """The length histogram the run's documents are drawn from (None: unpacked sequences):
    ``--seq-lengths FILE`` where given, else the plan's ``training.seq_lengths``."""
    planned = plan.training.length_histogram()
    if seq_lengths_file is None:
        return planned
    if planned is None:
        raise ConfigError(
            f"--seq-lengths {seq_lengths_file}: the plan was made for unpacked sequences (it "
            "has no training.seq_lengths), so its graph takes no position ids and cannot be "
            "given a document mask. Re-plan for the data with `autoplan plan MODEL "
            f"--seq-lengths {seq_lengths_file} ...`, or run without --seq-lengths")
    return read_seq_lengths(seq_lengths_file)


def packed_run_examples(data: Any, small: Any, histogram: Any) -> tuple[Any, Any]:
    """(data, small) with their token rows packed as documents of ``histogram``: ``data``
    (the run's rows; None where the run builds none) and ``small`` (the traced example)."""
    where = "a plan for packed documents (training.seq_lengths)"
    refuse_unpackable(small, where)
    small = packed_documents_example(small, histogram, DATA_SEED)
    if data is not None:
        refuse_unpackable(data, where)
        data = packed_documents_example(data, histogram, DATA_SEED)
    return data, small


def packed_documents_example(example, histogram, seed: int = 0):
    """``example`` with its rows packed as documents drawn from ``histogram`` (a
    ``LengthHistogram``) with ``seed`` (``sharding.doc_work.pack_documents``: the packing the
    planner prices): example inputs ``(tokens, position_ids)``."""
    refuse_unpackable(example)
    batch, seq_len = example.example_inputs[0].shape[:2]
    return packed_example(example, pack_documents(histogram, int(seq_len), int(batch), seed))


def describe(histogram: Any, data: Any) -> str:
    """One line for rank 0: what the run trains on."""
    pos = data.example_inputs[1]
    docs = int((document_ids(pos)[:, -1] + 1).sum())
    rows, seq_len = pos.shape
    return (f"data: {rows} packed rows of {seq_len} tokens, {docs} documents "
            f"({docs / rows:.3g} per row) drawn from {histogram.describe()}, seed {DATA_SEED}; "
            "position ids restart per document (document-masked attention)")


__all__ = ["DATA_SEED", "describe", "packed_run_examples", "run_histogram"]
