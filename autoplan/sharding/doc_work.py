"""Attention work of packed documents (``--seq-lengths``): what one rank's attention costs when
each micro-batch sequence of ``S`` tokens holds several documents behind a document mask.

Packing. Documents are drawn from the length histogram (independently, in proportion to their
counts), laid end to end and cut every ``S`` tokens, as torchtitan's and Megatron-LM's data
loaders pack pre-training text: no padding, and a document that runs past a sequence's end
continues as its own document at the start of the next (its positions restart at 0 there,
``position_ids``). ``PackedWork`` simulates ``samples`` such sequences with a fixed seed, so
the same histogram always prices the same.

Work. Under a document mask a query sees only keys of its own document (and, causal, not
after it): a packed sequence's attention is the sum over its documents of their own causal
attention, ``sum d (d + 1) / 2`` query-key pairs, not one causal square's ``S (S + 1) / 2``.
``dense_share`` is their ratio's expectation: the factor on the traced (one fixed-length
sequence's) attention. Non-causal attention counts ``sum d^2`` against ``S^2``.

Rings. On a ``c``-way context-parallel ring (``ring_work``) rank ``r`` holds its layout's
chunks of the sequence, and at ring step ``s`` computes its queries against the keys rank
``(r - s) mod c`` holds (``runtime/ring_attention``). The ranks wait for each other every step,
so a sequence's ring time is the sum over steps of the slowest rank's pairs at that step;
``ring_share`` is its expectation over the packed sequences against one device's causal
square: what a ring that skipped masked pairs would do (this runtime's ring does not, see
Kernels: it is priced at ``1 / c``; ``plan`` prints both). Where documents are short, every
step but the first (each rank's own block) has little work, and which rank is the slowest
depends on where boundaries fall: zigzag still halves the contiguous ring's worst step on long
documents; on short ones both are near the balanced ``dense_share / c``.

Kernels: the price follows the kernel the runtime runs (``runtime/document_attention.py``).
On a GPU, attention whose mask is proven a document mask runs as flex attention with a block
mask built from the document ids, which skips fully masked 128 x 128 blocks: priced as
skipping masked-out work at fine grain (``kernel="block_sparse"``: ``dense_share``; the
partly masked blocks it still computes are left out, so the price is optimistic by up to one
block row per document boundary). On a CPU (flex attention has no backward there, torch 2.13)
it runs SDPA with the dense boolean mask, which computes the whole square: priced at the
traced attention's full work (``kernel="dense"``: share 1). A ring (``cp`` or a tp-axis ring)
computes every block of a masked attention whole with its mask's columns
(``runtime/ring_attention.py``) on either device: priced at the balanced ``1 / c`` of the
square, whatever the layout; ``ring_share`` is what a ring skipping masked pairs would do,
the figure the plan's notes print beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from autoplan.errors import ConfigError
from autoplan.graph.opgraph import OpGraph
from autoplan.graph.oprules import is_attention
from autoplan.sharding.config_values import CP_LAYOUTS
from autoplan.sharding.ring_work import causal_at
from autoplan.sharding.seq_lengths import LengthHistogram, read_seq_lengths

_MAX_SAMPLES = 4096
KERNELS = ("block_sparse", "dense")


def runtime_kernel(device_kind: str) -> str:
    """The kernel the runtime runs a document-masked attention with off a ring on a device of
    ``device_kind`` (module doc): flex attention's block mask on a GPU, SDPA's dense mask on a
    CPU."""
    return "block_sparse" if device_kind == "gpu" else "dense"


@dataclass(frozen=True)
class PackedWork:
    """Documents of ``histogram`` packed into sequences of ``seq_len`` tokens (module doc)."""

    histogram: LengthHistogram
    seq_len: int
    samples: int = 256               # packed sequences simulated
    seed: int = 0
    kernel: str = "block_sparse"     # what runs off a ring: "block_sparse" or "dense" (doc)
    _cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) \
                or self.seq_len < 1:
            raise ConfigError(f"PackedWork: seq_len must be a positive int (tokens per packed "
                              f"sequence), got {self.seq_len!r}")
        if self.kernel not in KERNELS:
            raise ConfigError(f"PackedWork: kernel must be one of {list(KERNELS)}, got "
                              f"{self.kernel!r}")
        if not 1 <= self.samples <= _MAX_SAMPLES:
            raise ConfigError(f"PackedWork: samples must be 1..{_MAX_SAMPLES}, got "
                              f"{self.samples!r}")

    @cached_property
    def sequences(self) -> tuple[tuple[int, ...], ...]:
        """The simulated packed sequences, each as its documents' lengths in order (they sum to
        ``seq_len``)."""
        return pack_documents(self.histogram, self.seq_len, self.samples, self.seed)

    @cached_property
    def documents_per_sequence(self) -> float:
        return sum(len(s) for s in self.sequences) / len(self.sequences)

    def dense_share(self, causal: bool = True) -> float:
        """The expected attention work of a packed sequence over one unmasked sequence's."""
        return self.ring_share(1, "contiguous", causal)

    def ring_share(self, c: int, layout: str, causal: bool = True) -> float:
        """Ring attention's expected critical path on ``c`` ranks under ``layout``, as a share
        of one device's attention over one unmasked sequence (module doc)."""
        if layout not in CP_LAYOUTS:
            raise ConfigError(f"cp_layout must be one of {list(CP_LAYOUTS)}, got {layout!r}")
        if c < 1 or self.seq_len % (2 * c if layout == "zigzag" else c):
            raise ConfigError(f"a {c}-way {layout} ring needs seq_len {self.seq_len} divisible "
                              f"by {2 * c if layout == 'zigzag' else c}")
        key = (c, layout if c > 1 else "contiguous", causal)
        if key not in self._cache:
            total = sum(ring_critical_pairs(s, self.seq_len, c, key[1], causal)
                        for s in self.sequences)
            s = self.seq_len
            self._cache[key] = total / len(self.sequences) / (s * (s + 1) / 2 if causal
                                                               else s * s)
        return self._cache[key]

    def attention_share(self, causal: bool = True) -> float:
        """Off a ring, the share of one unmasked sequence's attention the kernel that runs
        computes: the masked pairs' (block-sparse) or the whole square (dense)."""
        return self.dense_share(causal) if self.kernel == "block_sparse" else 1.0

    def describe(self) -> str:
        run = ("computed by a kernel that skips masked blocks (flex attention, GPU)"
               if self.kernel == "block_sparse" else
               "but computed whole by SDPA's dense mask (CPU): priced at 1")
        return (f"documents packed into {self.seq_len:,}-token sequences "
                f"({self.documents_per_sequence:.3g} per sequence on average): attention "
                f"{self.dense_share():.3g} of an unmasked sequence's, {run}")


def pack_documents(histogram: LengthHistogram, seq_len: int, count: int, seed: int = 0
                   ) -> tuple[tuple[int, ...], ...]:
    """``count`` packed sequences of ``seq_len`` tokens, each as its documents' lengths in
    order (summing to ``seq_len``): documents drawn from ``histogram`` (independently, in
    proportion to its counts, with numpy's generator seeded ``seed``), laid end to end and cut
    every ``seq_len`` tokens, a document cut at a sequence's end continuing as its own at the
    start of the next (module doc). The planner prices these sequences (``PackedWork``) and
    ``autoplan run`` trains on them (``runtime/packed_data.py``)."""
    if count < 1 or seq_len < 1:
        raise ConfigError(f"pack_documents: count and seq_len must be >= 1, got {count}, "
                          f"{seq_len}")
    p = np.asarray(histogram.counts, dtype=np.float64)
    rng = np.random.default_rng(seed)
    need = count * seq_len
    lengths: list[int] = []
    total = 0
    while total < need:
        draw = rng.choice(np.asarray(histogram.lengths), size=max(16, int(
            (need - total) / histogram.mean_length * 1.2) + 1), p=p / p.sum())
        lengths.extend(int(x) for x in draw)
        total += int(draw.sum())
    out: list[tuple[int, ...]] = []
    cur: list[int] = []
    room = seq_len
    for d in lengths:
        while d > 0 and len(out) < count:
            take = min(d, room)
            cur.append(take)
            d -= take
            room -= take
            if room == 0:
                out.append(tuple(cur))
                cur, room = [], seq_len
        if len(out) == count:
            break
    return tuple(out)


def rank_chunks(s: int, c: int, layout: str) -> list[list[tuple[int, int]]]:
    """Each rank's token intervals ``[lo, hi)`` of a sequence of ``s`` tokens."""
    if layout == "zigzag":
        w = s // (2 * c)
        return [[(r * w, (r + 1) * w), ((2 * c - 1 - r) * w, (2 * c - r) * w)]
                for r in range(c)]
    w = s // c
    return [[(r * w, (r + 1) * w)] for r in range(c)]


def ring_critical_pairs(docs: tuple[int, ...], s: int, c: int, layout: str,
                        causal: bool) -> float:
    """Sum over the ring's ``c`` steps of the slowest rank's masked query-key pairs, for one
    packed sequence of documents ``docs`` (lengths in order)."""
    ends = np.cumsum(np.asarray(docs, dtype=np.int64))
    starts = ends - np.asarray(docs, dtype=np.int64)
    chunks = rank_chunks(s, c, layout)
    owner = np.asarray([r for r, cs in enumerate(chunks) for _ in cs])
    lo = np.asarray([a for cs in chunks for a, _ in cs], dtype=np.int64)
    hi = np.asarray([b for cs in chunks for _, b in cs], dtype=np.int64)
    pairs = _pairs(lo, hi, starts, ends, causal)          # (query chunk, key chunk)
    member = (owner[None, :] == np.arange(c)[:, None]).astype(np.float64)
    work = member @ pairs @ member.T                      # (query rank, key rank)
    ranks = np.arange(c)
    return float(sum(work[ranks, (ranks - step) % c].max() for step in range(c)))


def _pairs(lo: np.ndarray, hi: np.ndarray, starts: np.ndarray, ends: np.ndarray,
           causal: bool) -> np.ndarray:
    """Per (query chunk, key chunk) of the chunks ``[lo, hi)``, the pairs (query in the one,
    key in the other, same document, key not after the query where ``causal``), summed over
    the documents ``[starts, ends)``."""
    a0 = np.maximum(lo[:, None], starts[None, :])          # (chunk, document)
    a1 = np.minimum(hi[:, None], ends[None, :])
    n = np.clip(a1 - a0, 0, None)
    if not causal:
        return np.einsum("qd,kd->qk", n.astype(np.float64), n.astype(np.float64))
    q0, q1 = a0[:, None, :], a1[:, None, :]
    k0, k1 = a0[None, :, :], a1[None, :, :]
    got = _below(q1, k0, k1) - _below(q0, k0, k1)
    return np.where(n[:, None, :] > 0, got, 0.0).sum(axis=-1)


def _below(x: np.ndarray, k0: np.ndarray, k1: np.ndarray) -> np.ndarray:
    """Sum over queries ``q < x`` of the keys in ``[k0, k1)`` at or before ``q``."""
    nk = np.clip(k1 - k0, 0, None)
    m = np.clip(x - k0, 0, None)
    inside = m * (m + 1) // 2
    past = nk * (nk + 1) // 2 + (x - k1) * nk
    return np.where(x <= k1, np.where(m <= nk, inside, past), past).astype(np.float64)




def packed_work(graph: OpGraph, seq_lengths: Any, device_kind: str = "gpu"
                ) -> PackedWork | None:
    """``seq_lengths`` (a file path, a ``LengthHistogram`` or a ``PackedWork``; None: none) as
    the packing of ``graph``'s sequences: their length is its attention's query length; a
    histogram of many lengths in ``MAX_BINS`` bins (``LengthHistogram.binned``), priced for
    the kernel the runtime runs on ``device_kind`` (``runtime_kernel``)."""
    if seq_lengths is None:
        return None
    if isinstance(seq_lengths, PackedWork):
        return replace(seq_lengths, kernel=runtime_kernel(device_kind))
    if isinstance(seq_lengths, (str, os.PathLike)):
        seq_lengths = read_seq_lengths(seq_lengths)
    if not isinstance(seq_lengths, LengthHistogram):
        raise ConfigError(f"seq_lengths must be a file path, a LengthHistogram or a "
                          f"PackedWork, got {type(seq_lengths).__name__}")
    lengths = {graph.value(op.inputs[0]).meta.shape[-2] for op in graph.ops
               if is_attention(op)}
    if len(lengths) != 1:
        raise ConfigError(f"--seq-lengths packs documents into the model's sequences, but "
                          f"{graph.name!r} has " + ("no attention" if not lengths else
                                                    f"attention over lengths {sorted(lengths)}")
                          + "; plan it without --seq-lengths")
    return PackedWork(seq_lengths.binned(), lengths.pop(), kernel=runtime_kernel(device_kind))


def attention_share(graph: OpGraph, i: int, documents: PackedWork | None, cp: int,
                    layout: str, tp_ring: int) -> float | None:
    """Under packed ``documents``, the share of attention op ``i``'s traced work its slowest
    rank does: on a ``cp``-way ring, or a ``tp_ring``-way ring on the tp axis (1: none), the
    balanced ``1 / c`` (the runtime's ring computes a masked attention's blocks whole, in
    either ``layout``), else what the kernel that runs computes (``PackedWork.kernel``). None:
    not priced so (no documents, or not attention)."""
    if documents is None or not is_attention(graph.ops[i]):
        return None
    if cp > 1 or tp_ring > 1:
        return 1.0 / (cp if cp > 1 else tp_ring)
    return documents.attention_share(causal_at(graph, i) or document_causal_at(graph, i))


def useful_share(graph: OpGraph, i: int, documents: PackedWork | None) -> float | None:
    """Under packed ``documents``, the share of attention op ``i``'s traced work that is
    useful (the masked pairs, whatever kernel runs: what MFU counts). None: as
    ``attention_share``."""
    if documents is None or not is_attention(graph.ops[i]):
        return None
    return documents.dense_share(causal_at(graph, i) or document_causal_at(graph, i))


# ops a mask passes through unchanged in structure (one tensor in, the same pairs out)
_MASK_PASSES = frozenset({"aten.unsqueeze.default", "aten.expand.default", "aten.view.default",
                          "aten.reshape.default", "aten._to_copy.default", "aten.clone.default",
                          "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device",
                          "aten.alias.default", "aten.contiguous.default"})
_MASK_ANDS = frozenset({"aten.__and__.Tensor", "aten.bitwise_and.Tensor",
                        "aten.logical_and.default"})
_ORDERS = frozenset(f"aten.{c}.Tensor" for c in ("le", "lt", "ge", "gt"))
_SEEDED = ("rand", "bernoulli", "dropout", "multinomial", "normal")


def document_causal_at(graph: OpGraph, i: int) -> bool:
    """Whether attention op ``i`` reads a mask that is causal within what else it masks: the
    mask is an AND (``&``) of conjuncts, one of which compares two position tensors
    (``k <= q``: ``aten.le/lt/ge/gt.Tensor``) built from the traced shapes and the graph's
    user inputs only (no weight, buffer, constant or random draw). A document mask is so
    built from position ids: autoplan's Llama ands the same-document test with
    ``arange(s)[k] <= arange(s)[q]``, Hugging Face's with ``position_ids[k] <=
    position_ids[q]`` (positions rise within a document), so under packed documents its work
    is each document's causal attention (``ring_work.causal_at`` answers False for them: the
    mask reads an input, and the runtime does not skip its blocks on a ring)."""
    op = graph.ops[i]
    if len(op.inputs) < 4:
        return False
    found = graph.__dict__.setdefault("_autoplan_document_causal", {})
    if i not in found:
        found[i] = any(_orders(graph, c) for c in _conjuncts(graph, op.inputs[3]))
    return found[i]


def _producer(graph: OpGraph, name: str):
    cache = graph.__dict__.get("_autoplan_doc_producers")
    if cache is None:
        cache = {n: op for op in graph.ops for n in op.outputs}
        graph.__dict__["_autoplan_doc_producers"] = cache
    return cache.get(name)


def _conjuncts(graph: OpGraph, name: str) -> list[str]:
    """The values ``name`` is the AND of (through ops that keep its structure)."""
    out, todo, seen = [], [name], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        op = _producer(graph, n)
        if op is not None and op.target in _MASK_ANDS:
            todo.extend(op.inputs)
        elif op is not None and op.target in _MASK_PASSES and len(op.inputs) == 1:
            todo.append(op.inputs[0])
        else:
            out.append(n)
    return out


def _orders(graph: OpGraph, name: str) -> bool:
    """``name`` compares two position tensors, each built from shapes and user inputs."""
    op = _producer(graph, name)
    if op is None or op.target not in _ORDERS or len(op.inputs) != 2:
        return False
    users = set(graph.inputs)
    todo, seen = list(op.inputs), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        p = _producer(graph, n)
        if p is None:
            if n not in users:           # a weight, buffer or constant
                return False
            continue
        if p.params or any(w in p.target for w in _SEEDED):
            return False
        todo.extend(p.inputs)
    return True


__all__ = ["KERNELS", "PackedWork", "attention_share", "document_causal_at", "pack_documents",
           "packed_work", "rank_chunks", "ring_critical_pairs", "runtime_kernel",
           "useful_share"]
