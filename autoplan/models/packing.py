"""Packed documents for the example models: position ids that restart at every document, the
form Hugging Face causal LMs (and autoplan's own Llama) read a document mask from.

A packed row of ``S`` tokens holds documents of lengths ``d_1 .. d_k`` (summing to ``S``); its
position ids are ``0 .. d_1 - 1, 0 .. d_2 - 1, ...``. A model given them attends within each
document only (causal inside it), and its rotary positions restart per document, as if each
document had been its own sequence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from autoplan.errors import ConfigError

# families whose forward takes (tokens, position_ids)
PACKED_FAMILIES = frozenset({"llama", "hf-llama"})


def document_position_ids(rows: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """``(len(rows), seq_len)`` int64 position ids, each row's documents ``rows[b]`` (their
    lengths, in order, summing to ``seq_len``) counted from 0."""
    out = torch.empty(len(rows), seq_len, dtype=torch.int64)
    for b, docs in enumerate(rows):
        if sum(docs) != seq_len or min(docs, default=0) < 1:
            raise ConfigError(f"packed row {b}: document lengths {list(docs)!r:.80} must be "
                              f">= 1 and sum to the sequence length {seq_len}")
        out[b] = torch.cat([torch.arange(d) for d in docs])
    return out


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which document of its row each token is in (0, 1, ...): a new one wherever a position
    is not its predecessor's plus one (Hugging Face's ``find_packed_sequence_indices``)."""
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """``(b, 1, s, s)`` bool, True where query ``q`` may see key ``k``: same document, and
    ``k <= q``."""
    doc = document_ids(position_ids)
    s = position_ids.shape[-1]
    idx = torch.arange(s, device=position_ids.device)
    causal = idx[None, :] <= idx[:, None]
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def packed_example(example, rows: Sequence[Sequence[int]]):
    """``example`` with its tokens packed as documents ``rows`` (one list of lengths per
    row of the batch): example inputs ``(tokens, position_ids)``."""
    refuse_unpackable(example)
    tokens = example.example_inputs[0]
    if len(rows) != tokens.shape[0]:
        raise ConfigError(f"{len(rows)} packed rows for a batch of {tokens.shape[0]}")
    pos = document_position_ids(rows, tokens.shape[1]).to(tokens.device)
    return replace(example, example_inputs=(tokens, pos))


def refuse_unpackable(example, where: str = "packed documents") -> None:
    """ConfigError, saying what to do, where ``example``'s forward takes no position ids: its
    attention cannot be given a document mask, and training it on packed documents would let
    every token attend across documents (never done silently)."""
    family = example.family
    if family in PACKED_FAMILIES and len(example.example_inputs) == 1:
        return
    raise ConfigError(
        f"{where}: {example.name!r} ({family}) takes no position ids, so its attention cannot "
        "be given a document mask, and running it on packed documents would attend across "
        f"documents. Packed documents run on the families {sorted(PACKED_FAMILIES)} "
        "(position ids restarting per document); for this model re-plan without "
        "--seq-lengths (one document per sequence), or, with your own model, pass position "
        "ids (or a mask) as an input and train through the Python API (autoplan.compile)")


def eod_position_ids(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """Position ids of ``tokens`` (b, s) split into documents at ``eod_token``: each end-of-
    document token is its document's last, the next token starts a new one at position 0."""
    ends = (tokens == eod_token).to(torch.int64)
    starts = torch.zeros_like(ends)
    starts[:, 1:] = ends[:, :-1]
    starts[:, 0] = 1
    doc = starts.cumsum(-1)
    idx = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    first = torch.zeros_like(doc).scatter_reduce(
        1, doc - 1, idx, reduce="amin", include_self=False)
    return idx - first.gather(1, doc - 1)


__all__ = ["PACKED_FAMILIES", "document_ids", "document_mask", "document_position_ids",
           "eod_position_ids", "packed_example",
           "refuse_unpackable"]
