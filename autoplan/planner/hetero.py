"""Plans for heterogeneous clusters (``cluster/pools.py``): work in proportion to speed.

The search, in order:

1. **Baseline**: ``plan()`` on the cluster as its slowest pool's node type over all the nodes
   (``Cluster.slowest``): the answer of a planner that does not know the pools, and the figure
   the gain is reported against.
2. **Candidates**: the baseline's config and its alternatives that fit, and those of the
   slowest-GPU search forced to pp = the number of pools (pipelines rarely rank among the
   slowest GPU's best, but on pools their stages take work in proportion to speed; and with
   one chunk per rank where that search's best are all V schedules), each
   re-priced on the
   pools (``estimate/hetero.py``) where its stages (pp > 1) or replicas (pp = 1) each lie in
   one pool; a config that would straddle pools is left out (tp never crosses device types).
3. **Balance** each candidate:
   - stages on pools: layers per chunk. Start from the split minimising the largest chunk
     time, each chunk's layers at its device's per-layer seconds (read from the even split's
     stage times; greedy, which is exact for a min-max of ``n_c * t_c``), then move one layer
     between two chunks while the estimate (the simulated schedule) improves.
   - replicas on pools: micro-batches per replica (``dp_shares``, summing to global batch /
     micro-batch size): the same greedy at each device's seconds per micro-batch, then single
     micro-batch moves from the slowest replica to another while the estimate improves.
   A split that fits the devices' memory beats one that does not (under FSDP a replica of
   several micro-batches holds its gradients, under ZeRO-3 its weights, unsharded for the
   step: ``estimate/hetero.py``), and the even split beats a balanced one that does not fit.
4. The fastest balanced candidate wins; the even split of the baseline's config is always among
   them, so the result is never slower than running the baseline's config on the pools as is.

Not searched: uneven shares with pp > 1 (dp replicas each a whole pipeline in one pool). The
runtime's mesh puts pp outermost, so a replica holds one rank of every stage's block of ranks,
and pools are contiguous rank ranges: a pipelined replica lies in one pool only where every
stage does, i.e. on one pool. Planning it needs the runtime to lay dp outside pp (or renumber
ranks); until then only what runs is planned. Objectives (cost, energy, which pools and nodes
to use): ``objectives_pools.plan_pools``.

Pure and deterministic: the same inputs give the same plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from autoplan.errors import ConfigError
from autoplan.estimate.hetero import (STAGES, HeteroEstimate, estimate_hetero,
                                      placement)
from autoplan.estimate.partition import pipeline_units
from autoplan.graph.trace import as_graph
from autoplan.planner.hetero_planfile import hetero_plan
from autoplan.planner.search import plan
from autoplan.sharding.doc_work import packed_work
from autoplan.sharding.parallel_config import ParallelConfig

MAX_MOVES = 64            # local-search steps per candidate (each one estimate per neighbour)


@dataclass(frozen=True)
class HeteroCandidate:
    """One config balanced on the pools: its even split's step and the balanced one."""

    config: ParallelConfig
    even_step_s: float
    balanced: HeteroEstimate


@dataclass(frozen=True)
class HeteroPlan:
    """The heterogeneous search's answer: the baseline plan (the cluster as its slowest GPU),
    the winning candidate and every candidate tried, fastest first."""

    baseline: Any                              # Plan on Cluster.slowest()
    best: HeteroCandidate
    candidates: tuple[HeteroCandidate, ...]

    @property
    def baseline_step_s(self) -> float:
        return float(self.baseline.predicted["step_time_s"])

    @property
    def step_time_s(self) -> float:
        return self.best.balanced.step_time_s

    @property
    def speedup(self) -> float:
        """Baseline step over the heterogeneous plan's step (> 1: the pools pay)."""
        return self.baseline_step_s / self.step_time_s

    def summary_lines(self) -> list[str]:
        b, c = self.best.balanced, self.best.config
        lines = [f"Heterogeneous plan ({len(self.best.balanced.pool_of_unit)} "
                 f"{b.placement} on pools {runs(b.pool_of_unit)}):",
                 f"  config {_label(c)}" + (f", chunk_layers {list(c.chunk_layers)}"
                                            if c.chunk_layers else "")
                 + (f", dp_shares {runs(b.dp_shares)}" if b.dp_shares else ""),
                 f"  predicted step {self.step_time_s:.6g} s (even split on the pools "
                 f"{self.best.even_step_s:.6g} s)",
                 f"  the cluster as its slowest GPU: {self.baseline_step_s:.6g} s "
                 f"({_label(self.baseline.config)}); gain {self.speedup:.3f}x"]
        for cand in self.candidates[1:6]:
            lines.append(f"  also tried {_label(cand.config)}: {cand.balanced.step_time_s:.6g} s")
        return lines

    def to_plan(self, model: Any, cluster: Any, *, global_batch_size: int,
                **plan_options: Any) -> Any:
        """This result as a runnable Plan (``planner/hetero_planfile.py``) that
        ``autoplan.compile(model, cluster, plan=...)`` and ``autoplan run`` take: ``model`` (or
        its OpGraph), ``cluster`` and the options as given to ``plan_hetero``."""
        graph = as_graph(model, plan_options.pop("example_inputs", None),
                         loss_fn=plan_options.pop("loss_fn", None),
                         targets=plan_options.pop("targets", None), who="HeteroPlan.to_plan()",
                         error=ConfigError)
        return hetero_plan(self, graph, cluster, global_batch_size=global_batch_size,
                           **plan_options)

    def to_dict(self) -> dict[str, Any]:
        b, c = self.best.balanced, self.best.config
        return {"placement": b.placement, "pool_of_unit": list(b.pool_of_unit),
                "config": c.to_dict() if hasattr(c, "to_dict") else str(c),
                "dp_shares": list(b.dp_shares) if b.dp_shares else None,
                "step_time_s": self.step_time_s, "even_step_s": self.best.even_step_s,
                "slowest_gpu_step_s": self.baseline_step_s, "speedup": self.speedup}


def runs(values: Sequence[Any]) -> str:
    """``[4, 4, 4, 12, 12]`` as ``[4 x3, 12 x2]``: a long per-replica list, readable."""
    out: list[list[Any]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return "[" + ", ".join(f"{v} x{n}" if n > 1 else f"{v}" for v, n in out) + "]"


def _label(c: ParallelConfig) -> str:
    return (f"dp{c.dp} tp{c.tp} pp{c.pp}" + (f" cp{c.cp}" if c.cp > 1 else "")
            + f" mbs{c.micro_batch_size}" + (f" {c.schedule}" if c.pp > 1 else "")
            + (f" v{c.virtual_stages}" if c.virtual_stages > 1 else "")
            + (f" zero{c.zero_stage}" if c.zero_stage else ""))


def plan_hetero(model: Any, cluster: Any, *, global_batch_size: int,
                plan_fn: Callable[..., Any] = plan,
                example_inputs: Any = None, loss_fn: Any = None, targets: Any = None,
                profile: Any = "auto", pipelines: bool = True,
                progress: Callable[[str], None] | None = None, **plan_options: Any) -> HeteroPlan:
    """The search of the module docstring. ``plan_fn``: the homogeneous search
    (``autoplan.plan``); ``plan_options`` go to it, ``force`` included.
    ``pipelines``: also search the slowest GPU with pp = the number of pools (one more
    ``plan_fn`` call) for candidates whose stages fall on the pools."""
    if not getattr(cluster, "pools", ()):
        raise ConfigError("plan_hetero() plans heterogeneous clusters (pools, e.g. "
                          "dgx-a100-80gb:4+dgx-h100:4); use autoplan.plan() for this one")
    if plan_options.get("objective", "time") != "time" or any(
            plan_options.get(k) is not None for k in ("max_gpus", "tokens", "deadline_days",
                                                      "budget_usd")):
        raise ConfigError("plan_hetero() plans all the pools for step time; for --objective "
                          "cost or energy, --max-gpus, --tokens, --deadline or --budget-usd "
                          "use autoplan.planner.objectives_pools.plan_pools(), which also "
                          "chooses the pools and nodes to use")
    say = progress or (lambda _msg: None)
    graph = as_graph(model, example_inputs, loss_fn=loss_fn, targets=targets, who="plan_hetero()",
                     error=ConfigError)
    # the data's lengths, read once: the slowest-GPU search and every pool price them
    documents = packed_work(graph, plan_options.pop("seq_lengths", None))
    if documents is not None:
        plan_options["seq_lengths"] = documents
    say(f"planning {cluster.name} as its slowest GPU ({cluster.slowest().device.name})")
    baseline = plan_fn(graph, cluster.slowest(), global_batch_size=global_batch_size,
                       profile=profile, **plan_options)
    configs = [baseline.config] + [a.config for a in baseline.alternatives if a.fits]
    force = dict(plan_options.pop("force", None) or {})
    if pipelines and "pp" not in force and cluster.world_size % len(cluster.pools) == 0:
        # a pipeline with whole stages on each pool: the slowest-GPU search rarely ranks one
        # among its best, but on pools its stages take layers in proportion to speed
        # (and with one chunk per rank where the V schedules, whose rank 0 holds a tied
        # embedding and LM head once, crowd those out of the first search's best)
        for extra in ({"pp": len(cluster.pools)},
                      {"pp": len(cluster.pools), "virtual_stages": 1}):
            if "virtual_stages" in extra and ("virtual_stages" in force or any(
                    c.pp > 1 and c.virtual_stages == 1 for c in configs)):
                continue
            say(f"planning {cluster.name} as its slowest GPU with "
                + ", ".join(f"{k}={v}" for k, v in extra.items()))
            try:
                piped = plan_fn(graph, cluster.slowest(), global_batch_size=global_batch_size,
                                profile=profile, force={**force, **extra}, **plan_options)
                configs += [piped.config] + [a.config for a in piped.alternatives if a.fits]
            except ConfigError:
                pass          # no pipeline of that depth fits this model and batch
    found = []
    for config in dict.fromkeys(configs):
        try:
            placement(cluster, config)
        except ConfigError:
            continue          # a stage or replica would straddle pools
        say(f"balancing {_label(config)} on the pools")
        try:
            found.append(balance(graph, cluster, config, global_batch_size, profile=profile,
                                 seq_lengths=documents))
        except ConfigError:
            continue
    if not found:
        raise ConfigError(f"no candidate of the baseline plan fits the pools of {cluster.name}: "
                          "every one puts a stage or a replica across two device types; "
                          "force degrees that divide each pool (plan ... --pp, or a tp*cp "
                          "dividing the devices per pool)")
    fits = [f for f in found if f.balanced.estimate.fits] or found
    ordered = tuple(sorted(fits, key=lambda f: f.balanced.step_time_s))
    return HeteroPlan(baseline=baseline, best=ordered[0], candidates=ordered)


def balance(graph: Any, cluster: Any, config: ParallelConfig, global_batch_size: int, *,
            profile: Any = "auto", seq_lengths: Any = None) -> HeteroCandidate:
    """``config`` with its work split in proportion to each pool's speed (module docstring);
    ``seq_lengths``: the data's document lengths, priced per pool (``estimate_hetero``)."""
    def price(cfg: ParallelConfig, shares: Sequence[int] | None = None) -> HeteroEstimate:
        return estimate_hetero(graph, cluster, config=cfg, global_batch_size=global_batch_size,
                               dp_shares=shares, profile=profile, seq_lengths=seq_lengths)

    config = replace(config, dp_shares=None)
    even = price(replace(config, chunk_layers=None) if config.pp > 1 else config)
    if even.placement == STAGES:
        best = _balance_stages(graph, config, even, price)
    else:
        best = _balance_replicas(config, global_batch_size, even, price)
    if _better(even, best):
        best = even
    return HeteroCandidate(config=best.estimate.config, even_step_s=even.step_time_s,
                           balanced=best)


def min_max_split(total: int, seconds_per_item: Sequence[float]) -> tuple[int, ...]:
    """``total`` items over bins (each >= 1) minimising the largest ``n_b * t_b``: greedy, one
    item at a time to the bin whose time after it is least (exact for this min-max; ties to
    the first bin)."""
    bins = len(seconds_per_item)
    if total < bins:
        raise ConfigError(f"{total} items cannot give each of {bins} bins at least one")
    counts = [1] * bins
    for _ in range(total - bins):
        b = min(range(bins), key=lambda i: ((counts[i] + 1) * seconds_per_item[i], i))
        counts[b] += 1
    return tuple(counts)


def _balance_stages(graph: Any, config: ParallelConfig, even: HeteroEstimate,
                    price: Callable[..., HeteroEstimate]) -> HeteroEstimate:
    layers = len(pipeline_units(graph))
    chunks = config.pp * config.virtual_stages
    if layers < chunks:
        return even
    # seconds per layer on each pool: its stages' forward + backward over their layers
    per_layer = {}
    for pool in set(even.pool_of_unit):
        stages = [s for s, p in enumerate(even.pool_of_unit) if p == pool]
        held = sum(len(even.estimate.stages[s].layers) for s in stages)
        per_layer[pool] = even.pool_step_s[pool] / max(1, held)
    t = [per_layer[even.pool_of_unit[config.chunk_rank(c)]] for c in range(chunks)]
    start = min_max_split(layers, t)
    return _climb(start, lambda split: price(replace(config, chunk_layers=split)), minimum=1)


def _balance_replicas(config: ParallelConfig, global_batch_size: int, even: HeteroEstimate,
                      price: Callable[..., HeteroEstimate]) -> HeteroEstimate:
    total, rem = divmod(global_batch_size, config.micro_batch_size)
    if rem or total < config.dp:
        return even
    try:                # uneven shares run where the dp ranks meet once a step (not ep > 1)
        replace(config, dp_shares=(1,) * config.dp)
    except ConfigError:
        return even
    m = even.estimate.num_microbatches
    t = [even.pool_step_s[p] / m for p in even.pool_of_unit]
    start = min_max_split(total, t)
    pools = even.pool_of_unit

    def moves(shares: Sequence[int]) -> list[tuple[int, int]]:
        # replicas of one pool are alike: per ordered pair of pools, from the fullest replica
        # of one to the emptiest of the other
        out = []
        for a in sorted(set(pools)):
            for b in sorted(set(pools)):
                if a != b:
                    donor = max((j for j in range(len(shares)) if pools[j] == a),
                                key=lambda j: (shares[j], j))
                    taker = min((j for j in range(len(shares)) if pools[j] == b),
                                key=lambda j: (shares[j], j))
                    out.append((donor, taker))
        return out
    return _climb(start, lambda shares: price(config, shares), minimum=1, moves=moves)


def _better(a: HeteroEstimate, b: HeteroEstimate) -> bool:
    """Whether split ``a`` beats ``b``: it fits where ``b`` does not, or fits alike and is
    faster (a replica of more micro-batches may hold FSDP's state unsharded for the step, so
    moving work to it can trade memory for time)."""
    if a.estimate.fits != b.estimate.fits:
        return a.estimate.fits
    return a.step_time_s < b.step_time_s * (1 - 1e-12)


def _all_pairs(split: Sequence[int]) -> list[tuple[int, int]]:
    return [(a, b) for a in range(len(split)) for b in range(len(split)) if a != b]


def _climb(start: tuple[int, ...], price: Callable[[tuple[int, ...]], HeteroEstimate], *,
           minimum: int, moves: Callable[[Sequence[int]], list[tuple[int, int]]] = _all_pairs
           ) -> HeteroEstimate:
    """Hill-climb over splits: move one unit from bin a to bin b (the ``moves`` of a split;
    every ordered pair by default) while the step improves, taking the best move of each
    round (deterministic order). Each split is priced once: ``price`` is pure, and a round
    revisits the split the last move left (its reverse move)."""
    priced: dict[tuple[int, ...], HeteroEstimate] = {}

    def once(split: tuple[int, ...]) -> HeteroEstimate:
        if split not in priced:
            priced[split] = price(split)
        return priced[split]

    best_split, best = start, once(start)
    for _ in range(MAX_MOVES):
        improved = None
        for a, b in moves(best_split):
            if best_split[a] > minimum:
                split = list(best_split)
                split[a] -= 1
                split[b] += 1
                est = once(tuple(split))
                if _better(est, improved or best):
                    improved, improved_split = est, tuple(split)
        if improved is None:
            break
        best, best_split = improved, improved_split
    return best


__all__ = ["HeteroCandidate", "HeteroPlan", "balance", "min_max_split", "plan_hetero", "runs"]
