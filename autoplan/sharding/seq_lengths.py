"""The training data's document lengths (``plan/estimate --seq-lengths FILE``): a histogram or a
sample, read into one frozen ``LengthHistogram``.

The file is one of:

- text (CSV, TSV or whitespace): one row per line, blank lines and ``#`` comments skipped,
  an optional header line first (``length,count``). Every row is either ``LENGTH,COUNT`` (a
  histogram bin: ``COUNT`` documents of ``LENGTH`` tokens) or ``LENGTH`` alone (one sampled
  document); a file uses one form throughout.
- JSON: ``{"histogram": [[LENGTH, COUNT], ...]}``, ``{"lengths": [LENGTH, ...]}`` (a sample),
  a bare list of lengths, or a bare list of ``[LENGTH, COUNT]`` pairs.

Lengths are tokens per document, integers from 1 to ``MAX_LENGTH`` (2^24); counts are integers
from 0 (a bin may be empty, but not every bin) to ``MAX_COUNT``; at most ``MAX_ROWS`` rows.
Repeated lengths add up. Every problem raises ``ConfigError`` naming the file, the line or
entry, the value seen, and the form expected.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from autoplan.errors import ConfigError
from autoplan.safe_io import Limits, clip, decode, parse_json, read_text

MAX_LENGTH = 1 << 24           # tokens in one document (16.7M: far past any context window)
MAX_COUNT = 1 << 50            # documents in one bin
MAX_ROWS = 1_000_000           # histogram bins or sampled documents in one file
MAX_BINS = 256                 # bins the planner prices and a plan records
_LIMITS = Limits(max_bytes=32 << 20)
_SPLIT = re.compile(r"[,\t ;]+")
_FORMS = ("each row 'LENGTH,COUNT' (a histogram) or 'LENGTH' (a sample of document lengths), "
          "or JSON {\"histogram\": [[LENGTH, COUNT], ...]} or {\"lengths\": [...]}")


@dataclass(frozen=True)
class LengthHistogram:
    """Documents by length: ``counts[i]`` documents of ``lengths[i]`` tokens (lengths distinct
    and increasing)."""

    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.counts) or not self.lengths:
            raise ConfigError(f"LengthHistogram: {len(self.lengths)} lengths and "
                              f"{len(self.counts)} counts; give one count per length, at least "
                              "one")
        if list(self.lengths) != sorted(set(self.lengths)) or self.lengths[0] < 1:
            raise ConfigError("LengthHistogram: lengths must be distinct, increasing and >= 1; "
                              "build it with histogram_of(...)")
        if min(self.counts) < 0 or sum(self.counts) < 1:
            raise ConfigError("LengthHistogram: counts must be >= 0 with at least one document")

    @property
    def documents(self) -> int:
        return sum(self.counts)

    @property
    def tokens(self) -> int:
        return sum(n * c for n, c in zip(self.lengths, self.counts))

    @property
    def mean_length(self) -> float:
        return self.tokens / self.documents

    @property
    def max_length(self) -> int:
        return max(n for n, c in zip(self.lengths, self.counts) if c)

    def quantile(self, q: float) -> int:
        """The smallest length with at least ``q`` of the documents at or below it."""
        need, seen = q * self.documents, 0
        for n, c in zip(self.lengths, self.counts):
            seen += c
            if c and seen >= need:
                return n
        return self.max_length

    def binned(self, max_bins: int = MAX_BINS) -> LengthHistogram:
        """At most ``max_bins`` bins, as the planner prices and a plan records the data: the
        lengths as they are where they are few, else log-spaced bins from the shortest length
        to the longest, each at its documents' mean length (the tokens kept)."""
        if len(self.lengths) <= max_bins:
            return self
        lo, hi = self.lengths[0], self.lengths[-1]
        tokens: dict[int, int] = {}
        docs: dict[int, int] = {}
        for n, c in zip(self.lengths, self.counts):
            k = min(max_bins - 1, int(max_bins * math.log(n / lo) / math.log(hi / lo + 1e-12)))
            tokens[k] = tokens.get(k, 0) + n * c
            docs[k] = docs.get(k, 0) + c
        return histogram_of([(max(1, round(tokens[k] / docs[k])) if docs[k] else
                              self.lengths[0], docs[k]) for k in sorted(docs)], self.source)

    def describe(self) -> str:
        return (f"{self.documents:,} documents, {self.tokens:,} tokens: lengths "
                f"{min(n for n, c in zip(self.lengths, self.counts) if c):,} to "
                f"{self.max_length:,}, median {self.quantile(0.5):,}, mean "
                f"{self.mean_length:,.0f}" + (f" ({self.source})" if self.source else ""))


def histogram_of(pairs: list[tuple[int, int]], source: str = "") -> LengthHistogram:
    """The histogram of (length, count) pairs, repeated lengths added up."""
    merged: dict[int, int] = {}
    for n, c in pairs:
        merged[n] = merged.get(n, 0) + c
    keys = sorted(merged)
    return LengthHistogram(tuple(keys), tuple(merged[k] for k in keys), source)


def read_seq_lengths(path: str | os.PathLike[str]) -> LengthHistogram:
    """The histogram in file ``path`` (module docstring for the forms)."""
    what = "--seq-lengths file"
    text = read_text(path, what=what, error=ConfigError, limits=_LIMITS)
    return parse_seq_lengths(text, where=f"{what} {os.fspath(path)!r}")


def parse_seq_lengths(text: str | bytes, where: str = "--seq-lengths") -> LengthHistogram:
    """The histogram in ``text``, JSON where it starts with ``{`` or ``[``, else rows."""
    text = decode(text, what=where, error=ConfigError, limits=_LIMITS)
    body = text.lstrip("\ufeff \t\r\n")
    if body.startswith(("{", "[")):
        pairs = _json_pairs(parse_json(body, what=where, error=ConfigError, limits=_LIMITS),
                            where)
    else:
        pairs = _text_pairs(body, where)
    if not pairs:
        raise ConfigError(f"{where}: no document lengths found; write {_FORMS}")
    if len(pairs) > MAX_ROWS:
        raise ConfigError(f"{where}: {len(pairs):,} rows, over the {MAX_ROWS:,} limit; "
                          "give a histogram (LENGTH,COUNT rows) instead of a long sample")
    if sum(c for _, c in pairs) < 1:
        raise ConfigError(f"{where}: every count is 0; at least one document is needed")
    return histogram_of(pairs, source=where)


def _text_pairs(body: str, where: str) -> list[tuple[int, int]]:
    pairs: list[tuple[int, int]] = []
    columns = None
    for number, raw in enumerate(body.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cells = [c for c in _SPLIT.split(line) if c]
        if not pairs and columns is None and not any(ch.isdigit() for ch in line):
            continue                                   # a header: 'length,count'
        if len(cells) not in (1, 2):
            raise ConfigError(f"{where}, line {number}: {len(cells)} columns in "
                              f"{clip(line)!r}; write {_FORMS}")
        if columns is not None and len(cells) != columns:
            raise ConfigError(f"{where}, line {number}: {len(cells)} column(s) after rows of "
                              f"{columns}; use one form throughout: {_FORMS}")
        columns = len(cells)
        here = f"{where}, line {number}"
        length = _int(cells[0], f"{here}: length", 1, MAX_LENGTH)
        count = _int(cells[1], f"{here}: count", 0, MAX_COUNT) if columns == 2 else 1
        pairs.append((length, count))
    return pairs


def _json_pairs(obj: Any, where: str) -> list[tuple[int, int]]:
    if isinstance(obj, dict):
        keys = set(obj) & {"histogram", "lengths"}
        if len(keys) != 1 or set(obj) - {"histogram", "lengths", "source", "comment"}:
            raise ConfigError(f"{where}: a JSON object needs exactly one of 'histogram' or "
                              f"'lengths' (and optionally 'source', 'comment'), got keys "
                              f"{sorted(obj)!r:.120}; write {_FORMS}")
        key = keys.pop()
        rows = obj[key]
        if not isinstance(rows, list):
            raise ConfigError(f"{where}: '{key}' must be a list, got {type(rows).__name__}")
        if key == "lengths":
            return [(_int(v, f"{where}: lengths[{i}]", 1, MAX_LENGTH), 1)
                    for i, v in enumerate(rows)]
        return [_json_pair(v, f"{where}: histogram[{i}]") for i, v in enumerate(rows)]
    if not isinstance(obj, list):
        raise ConfigError(f"{where}: expected a JSON object or list, got {type(obj).__name__}; "
                          f"write {_FORMS}")
    if obj and isinstance(obj[0], list):
        return [_json_pair(v, f"{where}: [{i}]") for i, v in enumerate(obj)]
    return [(_int(v, f"{where}: [{i}]", 1, MAX_LENGTH), 1) for i, v in enumerate(obj)]


def _json_pair(v: Any, where: str) -> tuple[int, int]:
    if not isinstance(v, list) or len(v) != 2:
        raise ConfigError(f"{where}: expected [LENGTH, COUNT], got {clip(json.dumps(v))}")
    return _int(v[0], f"{where} length", 1, MAX_LENGTH), _int(v[1], f"{where} count", 0,
                                                               MAX_COUNT)


def _int(v: Any, where: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi] from a JSON number or a text cell (``1e3`` and ``1,000`` are
    refused: write the digits)."""
    if isinstance(v, str):
        cell = v.strip()
        if not re.fullmatch(r"[+-]?\d{1,20}", cell):
            raise ConfigError(f"{where}: {clip(cell)!r} is not a whole number; write digits "
                              f"only, from {lo:,} to {hi:,}")
        v = int(cell)
    elif isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53:
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}: expected a whole number, got {clip(v)!r}")
    if not lo <= v <= hi:
        raise ConfigError(f"{where}: {v:,} is out of range; it must be from {lo:,} to {hi:,}")
    return v


__all__ = ["LengthHistogram", "MAX_BINS", "MAX_COUNT", "MAX_LENGTH", "MAX_ROWS", "histogram_of",
           "parse_seq_lengths", "read_seq_lengths"]
