"""Split an OpGraph into pipeline chunks (contiguous op ranges).

For ``estimate`` the layers of the main repeated block are divided as evenly as possible over
``pp * virtual_stages`` chunks (earlier chunks take the remainder); what comes before the first
layer (embeddings) goes with the first chunk and what follows the last (head, loss) with the
last, as Megatron-LM does. Chunk ``c`` runs on pipeline rank ``c % pp``. The pipeline issue's
search replaces the even split by a dynamic program over these same boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.errors import ConfigError
from autoplan.graph.opgraph import Block, OpGraph


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    stop: int
    layers: tuple[str, ...]
    layer_ranges: tuple[tuple[int, int], ...]


def main_block(graph: OpGraph) -> Block | None:
    """The repeated block holding most ops (the transformer layers)."""
    if not graph.blocks:
        return None
    return max(graph.blocks, key=lambda b: (len(b.instances) * b.num_ops, -b.instances[0].start))


def even_split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def balanced_counts(n_layers: int, parts: int, layer_s: float, first_extra_s: float,
                    last_extra_s: float) -> list[int]:
    """Layers per chunk minimizing the slowest chunk when the first chunk also runs the
    embeddings (``first_extra_s``) and the last the head and loss (``last_extra_s``); the middle
    chunks differ by at most one layer. Exhaustive over the first and last counts (O(L^2))."""
    if parts == 1:
        return [n_layers]
    best: tuple[float, float, list[int]] | None = None
    # extra work only shrinks the first and last chunks: never beyond an even share
    cap = -(-n_layers // parts)
    for first in range(1, min(cap, n_layers - parts + 1) + 1):
        for last in range(1, min(cap, n_layers - first - (parts - 2)) + 1):
            rest = n_layers - first - last
            middle = parts - 2
            if middle == 0 and rest:
                continue
            if middle and rest < middle:
                continue
            counts = [first] + (even_split(rest, middle) if middle else []) + [last]
            loads = [c * layer_s for c in counts]
            loads[0] += first_extra_s
            loads[-1] += last_extra_s
            key = (max(loads), sum(x * x for x in loads))   # then the most even loads
            if best is None or key < best[:2]:
                best = (key[0], key[1], counts)
    return best[2] if best else even_split(n_layers, parts)


def partition(graph: OpGraph, num_chunks: int,
              weights: tuple[float, float, float] | None = None) -> tuple[Chunk, ...]:
    """Chunks of whole layers; with ``weights`` = (seconds of the ops before the layers, of one
    layer, of the ops after them) the split balances the chunks' times, else it is even."""
    block = main_block(graph)
    if num_chunks == 1:
        layers = block.instances if block else ()
        return (Chunk(0, 0, len(graph.ops), tuple(i.path for i in layers),
                      tuple((i.start, i.stop) for i in layers)),)
    if block is None:
        return _split_by_flops(graph, num_chunks)
    n = len(block.instances)
    if num_chunks > n:
        raise ConfigError(f"pipeline needs {num_chunks} chunks (pp x virtual_stages) but the "
                          f"model has only {n} layers in {block.name!r}; lower pp or "
                          "virtual_stages")
    if weights is not None:
        before, layer, after = weights
        counts = balanced_counts(n, num_chunks, layer, before, after)
    else:
        counts = even_split(n, num_chunks)
    chunks = []
    first = 0
    start = 0
    for c, count in enumerate(counts):
        insts = block.instances[first:first + count]
        first += count
        stop = len(graph.ops) if c == num_chunks - 1 else insts[-1].stop
        chunks.append(Chunk(c, start, stop, tuple(i.path for i in insts),
                            tuple((i.start, i.stop) for i in insts)))
        start = stop
    return tuple(chunks)


def _split_by_flops(graph: OpGraph, num_chunks: int) -> tuple[Chunk, ...]:
    """No repeated block: cut where the cumulative forward FLOPs cross equal shares."""
    if num_chunks > len(graph.ops):
        raise ConfigError(f"cannot cut {len(graph.ops)} ops into {num_chunks} pipeline chunks")
    total = max(graph.fwd_flops, 1)
    cuts = []
    acc = 0
    target = 1
    for i, op in enumerate(graph.ops):
        acc += op.fwd_flops
        if target < num_chunks and acc >= total * target / num_chunks and i + 1 < len(graph.ops):
            cuts.append(i + 1)
            target += 1
    while len(cuts) < num_chunks - 1:          # degenerate FLOP profiles: cut evenly
        cuts.append(len(graph.ops) * (len(cuts) + 1) // num_chunks)
    bounds = [0] + sorted(set(cuts))[: num_chunks - 1] + [len(graph.ops)]
    return tuple(Chunk(c, bounds[c], bounds[c + 1], (), ()) for c in range(len(bounds) - 1))
