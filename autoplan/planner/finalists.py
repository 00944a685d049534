"""The search's finalists, solved again with their own terms: without pipeline with their
data-parallel terms (``dp_problem``), pipelined with their whole step (``pipe_problem``), then
the pipelined ones simulated event by event.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from autoplan.estimate.cost_inputs import CostInputs
from autoplan.estimate.layout import chunks_for
from autoplan.estimate.result import Estimate
from autoplan.graph.analysis import analyze
from autoplan.planner import pipe_problem
from autoplan.planner.cost_context import CostContext
from autoplan.planner.search_costing import (SearchContext, cost_context, counted, dp_sharding,
                                      evaluate)
from autoplan.planner.dp_problem import DpPricing, keeps_weights_whole
from autoplan.planner.ilp import ILPSolution, solve
from autoplan.planner.problem import sharding_from_choice
from autoplan.planner.candidates import Candidate, only_adds_work
from autoplan.sharding.parallel_config import ParallelConfig


def refine_dp(sc: SearchContext, cands: list[Candidate], *, finalists: int = 3,
              within: float = 0.05) -> list[Candidate]:
    """The shared tp-axis ILP leaves out what its sharding does to data parallelism's traffic
    and the optimizer (it serves every ZeRO stage): the best few ILP-sharded configurations
    without pipeline (up to ``finalists``, within ``within`` of the best fitting one) are
    solved again with their own terms (``dp_problem``), and the sharding found replaces theirs
    where it is no slower (its ILP's objective is then the plan's predicted step time)."""
    out = list(cands)
    done: set[ParallelConfig] = set()
    best = min((c.est.step_time_s for c in cands if c.est.fits), default=None)
    fitting = [c for c in cands if c.est.fits]
    for k, c in sorted(enumerate(cands), key=lambda kc: kc[1].key()):
        cfg = c.est.config
        if len(done) == finalists or best is None or c.est.step_time_s > best * (1 + within):
            break
        if only_adds_work(c, fitting):   # a twin that saves no memory it needs (not refined
            continue                     # where the search's pruning never costed it)
        # tp 1 has no sharding to choose, but under ZeRO-3 which weights to keep whole
        fsdp_only = (c.ilp is None and cfg.tp == 1 and keeps_weights_whole(cfg)
                     and "dp_whole" not in sc.opts.force and sc.opts.fixed_sharding is None)
        if (not fsdp_only and (c.ilp is None or c.ilp.status not in ("optimal", "feasible"))
                or cfg.pp > 1 or not c.est.fits or cfg in done
                or cfg.dp_whole):   # (forced ones)
            continue
        done.add(cfg)
        found = dp_sharding(sc, c)
        if found is None:
            continue
        new, sh, sol = found
        better = [r for r in evaluate(sc, [new], sh, sol, c.label)
                  if r.est.fits and r.key() <= c.key()]
        if better:
            out[k] = better[0]
    return out


def refine_pipe_ilp(sc: SearchContext, cands: list[Candidate], *, finalists: int = 3,
                    rounds: int = 3, within: float = 0.05) -> list[Candidate]:
    """The shared ILP priced a pipelined configuration's sharding as one stage; the best few
    pipelined configurations (up to ``finalists``, their stage layout fixed) are solved again
    with their own step (``pipe_problem``: the longest of the schedule's critical paths, the
    dp terms of the stage where they are largest; those within ``within`` of the best
    configuration found, as ``refine_dp`` takes them), linearized at the shared answer, each
    new answer's critical path added and solved again until the answer's path is one of those
    priced and its dp stage stayed (up to ``rounds`` solves), each rank's memory a row within
    the room the shared answer leaves it; what it finds replaces the shared sharding where it
    fits and its simulated step is faster. Not with expert or context
    parallelism (their terms are the shared problem's only)."""
    out = list(cands)
    done = 0
    best = min((c.est.step_time_s for c in cands if c.est.fits), default=None)
    for k, c in sorted(enumerate(cands), key=lambda kc: kc[1].key()):
        cfg = c.est.config
        if done == finalists or best is None or c.est.step_time_s > best * (1 + within):
            break
        if (cfg.pp == 1 or not c.est.fits or c.ilp is None or cfg.ep > 1 or cfg.cp > 1
                or c.ilp.status not in ("optimal", "feasible") or c.label != "search"):
            continue
        done += 1
        found = _pipelined_step_sharding(sc, c, rounds)
        if found is not None:
            out[k] = found
    return out


@dataclass(frozen=True)
class _PipeSetting:
    """One pipelined finalist's problem, before its solves: its micro-batches, the cost
    context of its mesh, its chunks, ``pipe_problem``'s terms, and each rank's memory row
    with the room the shared answer leaves it."""

    config: ParallelConfig
    m: int
    base: CostContext
    chunks: tuple[Any, ...]
    made: pipe_problem.PipeTerms
    rows: tuple[tuple[Any, float], ...]

    def build(self, sc: SearchContext, reference: tuple[int, ...],
              paths: tuple = ()) -> pipe_problem.PipeProblem:
        """The problem linearized at ``reference``, pricing ``paths`` besides its own."""
        base = self.base
        pricing = DpPricing(config=self.config, cluster=sc.cluster, microbatches=self.m,
                            compute=base.compute, profile=sc.profile,
                            interference=base.interference)
        return pipe_problem.build(sc.graph, pricing, chunks=self.chunks,
                                  context_for=lambda pol: replace(base, recompute=pol),
                                  reference=reference, made=self.made, memory_rows=self.rows,
                                  paths=paths)


def _pipelined_step_sharding(sc: SearchContext, c: Candidate, rounds: int
                             ) -> Candidate | None:
    """``c`` with the sharding its own pipelined step prefers, where that fits and its
    simulated step is faster than the shared answer's; else None."""
    cfg = c.est.config
    # the objective is the simulated step: the answers and the shared one compared so
    first = evaluate(sc, [cfg], c.sharding, c.ilp, c.label, simulate=True)
    if not first:
        return None
    simulated = first[0].est
    setting = _pipe_setting(sc, c, simulated)
    found, pipe = _solve_with_cutting_planes(sc, c, setting, rounds)
    if not found:
        return None
    # the answer the last problem (every path found) prices lowest, simulated against the
    # shared answer's simulated step where that problem prices it lower
    choice = min(found, key=pipe.problem.objective)
    if pipe.problem.objective(choice) >= pipe.problem.objective(c.ilp.choice) * (1 - 1e-9):
        return None
    sh = sharding_from_choice(sc.graph, cfg.tp, pipe.red, choice)
    faster = [r for r in evaluate(sc, [cfg], sh, found[choice], c.label, simulate=True)
              if r.est.fits and r.est.step_time_s < simulated.step_time_s * (1 - 1e-9)]
    if not faster:
        return None
    # (kept in closed form, as the others are ranked until refine_pipelined)
    return evaluate(sc, [cfg], sh, found[choice], c.label)[0]


def _pipe_setting(sc: SearchContext, c: Candidate, simulated: Estimate) -> _PipeSetting:
    """The terms of ``c``'s pipelined problem, each rank's memory bounded by the room the
    shared answer's ``simulated`` estimate leaves it, beside what the choice does not decide
    (transient buffers, the margin), with the micro-batches in flight the simulation found
    there."""
    cfg = c.est.config
    m = cfg.microbatches(sc.global_batch_size)
    base = cost_context(sc, cfg, m)
    chunks = chunks_for(CostInputs(graph=sc.graph, analysis=analyze(sc.graph),
                                   sharding=c.sharding, compute=base.compute,
                                   cluster=sc.cluster, config=cfg,
                                   documents=sc.opts.seq_lengths))
    made = pipe_problem.terms(sc.graph, sc.cluster, cfg, chunks,
                              lambda pol: replace(base, recompute=pol))
    held = pipe_problem.rank_memory(made, cfg, m, [st.microbatches_in_flight
                                                   for st in simulated.stages])
    rows = tuple((row, sc.cluster.device.memory_bytes - st.memory.total_bytes
                  + row.value(made.red.problem, c.ilp.choice))
                 for row, st in zip(held, simulated.stages))
    return _PipeSetting(config=cfg, m=m, base=base, chunks=tuple(chunks), made=made,
                        rows=rows)


def _solve_with_cutting_planes(
        sc: SearchContext, c: Candidate, setting: _PipeSetting, rounds: int
) -> tuple[dict[tuple[int, ...], ILPSolution], pipe_problem.PipeProblem]:
    """The answers of up to ``rounds`` solves, each adding the last answer's own critical
    path to those priced (a cutting plane), and the last problem built; stops where the
    answer's path is one of them and its dp rank stayed (the objective priced it exactly)."""
    pipe = setting.build(sc, c.ilp.choice)
    found: dict[tuple[int, ...], ILPSolution] = {}
    for _ in range(rounds):
        sol = counted(solve(pipe.problem, time_limit_s=sc.opts.ilp_time_limit_s,
                            start=c.ilp.choice), sc.stats, setting.config,
                      "the pipelined step")
        if sol.status not in ("optimal", "feasible") or sol.choice in found:
            break
        found[sol.choice] = sol
        moved = setting.build(sc, sol.choice, pipe.paths)
        if moved.path in pipe.paths and moved.worst == pipe.worst:
            break
        pipe = moved
    return found, pipe


def refine_pipelined(sc: SearchContext, cands: list[Candidate], *, finalists: int = 8,
                     within: float = 0.10) -> list[Candidate]:
    """Pipelined candidates were screened with the closed form; simulate the best few and the
    best of each schedule at each micro-batch size, compiled or not, within ``within`` of the
    best, so that the plan's figures are the simulator's and no schedule's optimism in the
    closed form crowds out another's best. (The closed form is within 2.5 % of the simulation
    on the benchmark's plans, ``benchmarks/search_time.py``: a schedule's best further behind
    cannot win.)"""
    piped = sorted((c for c in cands if c.est.config.pp > 1 and c.est.fits), key=Candidate.key)
    if not piped:
        return cands
    chosen = piped[:finalists]
    best_of: dict[tuple[str, int], Candidate] = {}
    for c in piped:
        if c.est.step_time_s <= piped[0].est.step_time_s * (1 + within):
            best_of.setdefault((c.est.config.schedule, c.est.config.micro_batch_size,
                                c.est.config.compiled), c)
    chosen += best_of.values()
    keep = [c for c in cands if c.est.config.pp == 1]
    seen = set()
    for c in chosen:
        if id(c) in seen:
            continue
        seen.add(id(c))
        keep += evaluate(sc, [c.est.config], c.sharding, c.ilp, c.label, simulate=True)
    return keep
