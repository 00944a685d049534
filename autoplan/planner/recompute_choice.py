"""Recomputation chosen per layer for the search's finalists (``recompute_dp.solve_chain``).

The search costs one policy per configuration (or per pipeline stage). For the fastest few
configurations that recompute, each stage's layers become a chain: per layer and per policy
(``none``, ``selective``, ``ops``, ``full``) its kept bytes, recompute seconds and working
set, as ``chunk_cost.range_cost`` prices them on the configuration's sharding. The stage's
budget is what its estimate leaves to its layers' activations: the device memory less the
model states, the margin, ZeRO-3's gathered weights and the activations outside the layers
(times the micro-batches in flight); the largest working set outside the layers floors every
layer's. Where the chain's answer differs from the uniform policy, the configuration with
``layer_recompute`` (its stage split kept) is estimated again and added to the candidates:
the search's choice then takes it where it fits and is faster.

Activation offload joins the choice where the search may offload layers
(``search_space.layer_offload_offered``: GPUs, layers not compiled, offload neither forced nor
turned off), pipelines included: each layer's options are then also its policies ``none``,
``ops`` and ``full`` with what they keep sent to host memory (``estimate/activation_offload.
layer_offload``: the bytes moved, the copies' exposed seconds behind the part after the layer
as it costs recomputing nothing, so never less exposed than the estimate finds), and each
stage's host budget is its devices' share of the node's host memory less what its estimate
offloads there besides activations. The answer is written as ``layer_offload`` (one flag per
layer in model order), and configurations that offload without recomputing are refined too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autoplan.estimate.activation_offload import layer_offload
from autoplan.estimate.chunk_cost import chunk_cost, chunk_parts, range_cost
from autoplan.estimate.cost_inputs import CostInputs
from autoplan.estimate.estimator import chunk_offload_flags, chunk_policy
from autoplan.estimate.layout import chunks_for
from autoplan.planner.candidates import Candidate
from autoplan.planner.recompute_dp import ChainLayer, ChainSolution, LayerOption, solve_chain
from autoplan.planner.search_costing import SearchContext, cost_inputs, evaluate
from autoplan.planner.search_space import layer_offload_offered, selective_compiles
from autoplan.sharding.parallel_config import RECOMPUTE, ParallelConfig, strongest_recompute

# the policies whose saved tensors the runtime's offload hooks reach (selective checkpointing
# keeps its own, ``runtime/activation_offload.py``)
_OFFLOADABLE = ("none", "ops", "full")

# forcing any of these pins the recomputation: nothing to choose
_PINNED = ("recompute", "stage_recompute", "layer_recompute")


def refine_recompute(sc: SearchContext, cands: list[Candidate], *, finalists: int = 4
                     ) -> list[Candidate]:
    """``cands`` and, for the ``finalists`` fastest fitting ones that recompute (of the compiled
    and of the eager ones each), the same configuration with its recomputation chosen per
    layer, where that differs. A compiled
    configuration chooses among the policies its compiled layers run (``compiled_policies``);
    where compilation is not forced, its eager twin is refined too with offload per layer
    (``layer_offload_offered``), which the compiled layers cannot take."""
    if any(k in sc.opts.force for k in _PINNED):
        return cands
    recomputing = sorted((c for c in cands if c.est.fits and (
        c.est.config.recompute != "none" or c.est.config.offloads_activations)),
        key=Candidate.key)
    # the fastest of each family: compiled layers choose among fewer policies (and cannot
    # offload), so an eager configuration behind them uniformly may be ahead per layer
    chosen = [c for compiled in (True, False)
              for c in [c for c in recomputing if c.est.config.compiled == compiled][:finalists]]
    out = list(cands)
    for c in chosen:
        for start in _refined_starts(sc, c):
            offload = layer_offload_offered(start.est.config, sc.opts, sc.cluster)
            new = per_layer_config(cost_inputs(sc, start.est.config, start.sharding), start.est,
                                   offload=offload)
            if new is None or new == start.est.config:
                continue
            out += [r for r in evaluate(sc, [new], start.sharding, start.ilp, start.label,
                                        simulate=new.pp > 1) if r.est.fits]
    return out


def _refined_starts(sc: SearchContext, c: Candidate) -> list[Candidate]:
    """``c`` and, where ``c`` is compiled by the search's choice (not forced) and its eager twin
    could offload layers that ``c`` cannot, that twin estimated (its own stages and memory)."""
    config = c.est.config
    if not config.compiled or "compiled" in sc.opts.force:
        return [c]
    twin = replace(config, compiled=False)
    if not layer_offload_offered(twin, sc.opts, sc.cluster):
        return [c]
    return [c] + evaluate(sc, [twin], c.sharding, c.ilp, c.label, simulate=twin.pp > 1)


def compiled_policies(config: ParallelConfig) -> tuple[str, ...]:
    """The recomputation policies ``config``'s layers can run: every one eagerly or where its
    compiled layers hold no collectives; else none and full (``search_space.
    selective_compiles``: a selectively checkpointed compiled layer must hold no graph break)."""
    return RECOMPUTE if selective_compiles(config) else ("none", "full")


def per_layer_config(ci: CostInputs, est: Any, *, offload: bool = False
                     ) -> ParallelConfig | None:
    """The configuration of ``est`` (an ``Estimate`` of ``ci.config``) with the policy of each
    layer chosen by the chain DP (its stage split kept), and with ``offload`` whether each
    layer offloads too; None where a stage's chain has no answer."""
    config = ci.config
    chunks = chunks_for(ci)
    policies: dict[int, str] = {}
    offloads: dict[int, bool] = {}
    first = [sum(len(ch.layer_ranges) for ch in chunks[:k]) for k in range(len(chunks))]
    allowed = compiled_policies(config)
    if config.offload_activations:     # a count per chunk does not offload selective layers
        allowed = tuple(p for p in allowed if p != "selective")
    for s, stage in enumerate(est.stages):
        layers, index = stage_chain(ci, chunks, config.rank_chunks(s), stage, first,
                                    offload=offload, policies=allowed)
        if not layers:
            continue
        budget = stage_budget(ci, chunks, config.rank_chunks(s), stage)
        sol = solved_chain(ci, layers, budget, stage.microbatches_in_flight,
                           stage_host_budget(ci, stage) if offload else None)
        if sol is None:
            return None
        policies.update(zip(index, sol.policies))
        offloads.update(zip(index, sol.offloads))
    if not policies:
        return None
    chosen = tuple(policies[k] for k in range(len(policies)))
    flags = tuple(offloads[k] for k in range(len(offloads)))
    # offload chosen per layer replaces the count per chunk (none offloading: neither)
    sent = ({"offload_activations": 0, "layer_offload": flags if any(flags) else None}
            if offload else {})
    counts = tuple(len(ch.layers) for ch in chunks) if config.pp > 1 else None
    if len(set(chosen)) == 1:
        return replace(config, recompute=chosen[0], stage_recompute=None,
                       layer_recompute=None, chunk_layers=counts, **sent)
    return replace(config, recompute=strongest_recompute(chosen), stage_recompute=None,
                   layer_recompute=chosen, chunk_layers=counts, **sent)


def solved_chain(ci: CostInputs, layers: list[ChainLayer], budget_bytes: float,
                 in_flight: float, host_budget_bytes: float | None) -> ChainSolution | None:
    """``solve_chain``'s answer for the chain, kept on the graph: the search's finalists and
    the searches of one model (a schedule each, say) often pose the same chain and budgets.
    The key is every value the answer depends on, so a kept answer is the one it would give."""
    cache = ci.graph.__dict__.setdefault("_autoplan_chain_solutions", {})
    key = (tuple(layers), budget_bytes, in_flight, host_budget_bytes)
    if key not in cache:
        if len(cache) > 4096:
            cache.clear()
        cache[key] = solve_chain(layers, budget_bytes=budget_bytes, in_flight=in_flight,
                                 host_budget_bytes=host_budget_bytes)
    return cache[key]


def stage_chain(ci: CostInputs, chunks: Any, mine: tuple[int, ...], stage: Any,
                first: list[int], *, offload: bool = False,
                policies: tuple[str, ...] = RECOMPUTE) -> tuple[list[ChainLayer], list[int]]:
    """The chain of a stage's layers (its chunks', in order) and their model-order indices,
    each with an option per policy of ``policies``; every option's working set floored at the
    largest outside the layers; with ``offload``, the offloaded twin of each policy the hooks reach (where it moves any bytes)."""
    floor = 0.0
    for k in mine:
        for s, e, is_layer in chunk_parts(chunks[k]):
            if not is_layer:
                floor = max(floor, range_cost(ci, s, e, "none").working_set_bytes)
    layers, index = [], []
    for k in mine:
        like = {(u.start, u.stop): u.like for u in chunks[k].units}
        parts = chunk_parts(chunks[k])
        for j, span in enumerate(chunks[k].layer_ranges):
            costs = {p: range_cost(ci, *like.get(span, span), p) for p in policies}
            options = [LayerOption(policy=p, kept_bytes=rc.activation_bytes,
                                   recompute_s=rc.recompute_s,
                                   working_bytes=max(rc.working_set_bytes, floor))
                       for p, rc in costs.items()]
            if offload:
                options += _offloaded(ci, chunks[k], parts, parts.index((*span, True)), like,
                                      costs, floor)
            layers.append(ChainLayer(options=tuple(options)))
            index.append(first[k] + j)
    return layers, index


def _offloaded(ci: CostInputs, chunk: Any, parts: list[tuple[int, int, bool]], at: int,
               like: dict, costs: dict[str, Any], floor: float) -> list[LayerOption]:
    """The offloaded options of the layer at ``parts[at]`` of ``chunk``: its copies hide
    behind the next part's compute as it costs recomputing nothing (the estimate's window is
    no smaller); the first part of a chunk after the first keeps its received input."""
    after = None
    if at + 1 < len(parts):
        s, e, is_layer = parts[at + 1]
        after = range_cost(ci, *(like.get((s, e), (s, e)) if is_layer else (s, e)), "none")
    out = []
    for p in (p for p in _OFFLOADABLE if p in costs):
        rc = costs[p]
        sent = layer_offload(ci.cluster, "", rc, after, received=at == 0 and chunk.start > 0,
                             policy=p)
        if sent.moved_bytes > 0:
            out.append(LayerOption(policy=p, kept_bytes=rc.activation_bytes - sent.moved_bytes,
                                   recompute_s=rc.recompute_s,
                                   working_bytes=max(rc.working_set_bytes, floor),
                                   offload=True, moved_bytes=sent.moved_bytes,
                                   offload_s=sent.exposed_s))
    return out


def stage_host_budget(ci: CostInputs, stage: Any) -> float:
    """Host bytes one device of a stage may fill with offloaded activations: its share of the
    node's host memory (the node's devices share it) less what its estimate already offloads
    there besides activations (optimizer state, weights, NVMe buffers)."""
    share = ci.cluster.host.memory_bytes / ci.cluster.devices_per_node
    acts = stage.offloaded_activation_bytes_per_microbatch * stage.microbatches_in_flight
    return share - (stage.memory.offloaded_bytes - acts)


def stage_budget(ci: CostInputs, chunks: Any, mine: tuple[int, ...], stage: Any) -> float:
    """Bytes a stage's layers may keep and work in: the device memory less everything else
    its estimate holds (model states, margin, ZeRO-3's gathered weights beyond the working
    sets, the activations outside the layers for every micro-batch in flight)."""
    mem = stage.memory
    costs = [chunk_cost(ci, chunks[k], chunk_policy(ci.config, chunks, k),
                        chunk_offload_flags(ci.config, chunks, k)) for k in mine]
    gathered = mem.transient_bytes - max(c.working_set_bytes for c in costs)
    outside = sum(range_cost(ci, s, e, "none").activation_bytes
                  for k in mine for s, e, is_layer in chunk_parts(chunks[k]) if not is_layer)
    others = mem.params_bytes + mem.grads_bytes + mem.optimizer_bytes + mem.margin_bytes
    return (float(ci.cluster.device.memory_bytes) - others - max(gathered, 0.0)
            - stage.microbatches_in_flight * outside)
