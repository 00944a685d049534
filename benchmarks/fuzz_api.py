"""The API calls ``fuzz_arguments.py`` makes with bad arguments: ``autoplan.load_plan``,
``trace``, ``plan``, ``estimate``, ``compile``, ``Cluster.from_spec`` and ``Trainer.step``,
each a (name, call) pair on that script's fixtures (``fx``: its files, and the small model,
graph and one-process plan it made)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

Call = tuple[str, Callable[[], Any]]


def clusters(fx: Any) -> list[str]:
    """CLUSTER arguments that name no cluster."""
    return ["", "no-such-cluster", "local:0", "local:-1", "local:x", "dgx-h100:0",
            "dgx-h100:99999999", "local:1:2", "dgx-h100/0", "dgx-h100/9", "dgx-h100/x:2", os.path.join(fx.tmp, "missing.yaml"), fx.folder,
            fx.plan, fx.binary]


def api_calls(fx: Any) -> list[Call]:
    return (_load_plan_calls(fx) + _trace_calls(fx) + _plan_calls(fx) + _estimate_calls(fx)
            + _compile_calls(fx)
            + [(f"Cluster.from_spec({_r(v)})", lambda v=v: _cluster().from_spec(v))
               for v in [3, "", "local:0", "nope", None]])


def _cluster():
    from autoplan import Cluster
    return Cluster


def _load_plan_calls(fx: Any) -> list[Call]:
    import autoplan
    a = fx.api
    non_paths = [3, 3.5, [fx.plan], {"path": fx.plan}, None, object(), "a\0b", b"\xff\0",
                 a["graph"], a["model"], _cluster().local(1), fx.folder, fx.empty, fx.binary,
                 fx.cluster, ""]
    out = [(f"load_plan({_r(v)})", lambda v=v: autoplan.load_plan(v)) for v in non_paths]
    for kw in [dict(model=3, example_inputs=(a["x"],)), dict(cluster=3), dict(cluster="nope"),
               dict(cluster="local:0"), dict(graph=3), dict(graph="x"), dict(replan="yes"),
               dict(top_k=2), dict(model=a["model"]), dict(model=a["model"], example_inputs=3),
               dict(replan=True, model=a["graph"], cluster="local:1", global_batch_size=0)]:
        out.append((f"load_plan(plan, {_r(kw)})",
                    lambda kw=kw: autoplan.load_plan(fx.plan, **kw)))
    return out


def _trace_calls(fx: Any) -> list[Call]:
    import torch

    import autoplan
    a = fx.api
    model, x, y, loss = a["model"], a["x"], a["y"], a["loss_fn"]
    cases = [((3, (x,)), {}), ((model, None), {}), ((model, ()), {}), ((model, (x, x)), {}),
             ((model, (torch.randn(2, 9),)), {}), ((model, ("s",)), {}),
             ((model, (x,)), dict(loss_fn=loss)), ((model, (x,)), dict(loss_fn=3, targets=y)),
             ((model, (x,)), dict(loss_fn=loss, targets=3)), ((model, 3), {}),
             ((model, {"x": x}), {}), ((model, (x.to(torch.int64),)), {}),
             ((model, (torch.randn(0, 8),)), {})]
    return [(f"trace({_r(args)}, {_r(kw)})", lambda a_=args, k=kw: autoplan.trace(*a_, **k))
            for args, kw in cases]


def _plan_calls(fx: Any) -> list[Call]:
    import autoplan
    g = fx.api["graph"]
    bad = [dict(global_batch_size=v) for v in (0, -1, 1.5, "8", True, None, 10 ** 12,
                                                10 ** 400, 2 ** 24 + 1)]
    bad += [dict(precision=v) for v in ("fp8", 3, None)]
    bad += [dict(optimizer=v) for v in ("lion", 3)]
    bad += [dict(profile=v) for v in (3, "x.json", "nope", fx.binary)]
    bad += [dict(top_k=v) for v in (-1, "a", 2.5, None)]
    bad += [dict(max_tp=v) for v in (0, -2, "2", 2.5)] + [dict(max_pp=v) for v in (0, -1, "x")]
    bad += [dict(force=v) for v in ({"tp": 0}, {"bogus": 1}, {"tp": "2"}, {"Tp": 2},
                                    {"zero_stage": 9}, {"micro_batch_size": 0}, [("tp", 2)],
                                    {"schedule": "x"}, {"recompute": 3}, {"chunk_layers": "a"},
                                    {1: 2}, "tp=2")]
    bad += [dict(pin=v) for v in ({"x": "y"}, 3, {"*:linear": 3}, {3: "x"})]
    bad += [dict(micro_batch_sizes=v) for v in ((0,), 3, (), ("a",), (-2,))]
    bad += [dict(zero_stages=v) for v in ((7,), (), 3)]
    bad += [dict(recompute=v) for v in (("x",), (), "full")]
    bad += [dict(offload_optimizer=v) for v in ((3,), (), True)]
    bad += [dict(ilp_time_limit_s=v) for v in (-1, float("nan"), 0, "x", float("inf"))]
    bad += [dict(memory_margin_bytes=v) for v in (-1e30, "x", float("nan"))]
    bad += [dict(expert_capacity_factor=v) for v in (0, float("nan"), "x")]
    bad += [dict(sharding=v) for v in ("x", 3)]
    bad += [dict(progress=3), dict(name=3), dict(fixed_sharding=3), dict(bogus=1)]
    bad += [dict(objective=v) for v in ("speed", 3, None)]
    bad += [dict(max_gpus=v) for v in (0, -1, 2.5, "4", True, 10 ** 30)]
    bad += [dict(tokens=v) for v in (0, -5, 1.5, "1e9", float("nan"), 10 ** 40)]
    bad += [dict(deadline_days=3), dict(budget_usd=5)]          # without tokens
    bad += [dict(tokens=10 ** 9, deadline_days=v) for v in (0, -1, float("inf"), "x")]
    bad += [dict(tokens=10 ** 9, budget_usd=v) for v in (0, float("nan"), "x")]
    bad += [dict(economics=v) for v in (3, {"bogus": 1}, {"tdp_watt": -1},
                                        {"usd_per_gpu_hour": float("inf")},
                                        {"idle_fraction": 1.5}, {"tdp_watt": "700"})]
    bad += [dict(objective="cost"), dict(objective="energy")]    # a CPU: no price, no power
    out = []
    for kw in bad:
        full = {"global_batch_size": 8, "profile": None, **kw}
        out.append((f"plan(graph, 'local:1', {_r(kw)})",
                    lambda full=full: autoplan.plan(g, "local:1", **full)))
    for cl in clusters(fx) + [3, None, 2.5, ["local:1"]]:
        out.append((f"plan(graph, {_r(cl)})",
                    lambda cl=cl: autoplan.plan(g, cl, global_batch_size=8, profile=None)))
    for m in [3, None, "gpt-tiny", [g], fx.graph]:
        out.append((f"plan({_r(m)}, 'local:1')",
                    lambda m=m: autoplan.plan(m, "local:1", global_batch_size=8, profile=None)))
    out.append(("plan(graph, 'local:4', global_batch_size=2**24)",
                lambda: autoplan.plan(g, "local:4", global_batch_size=2 ** 24, profile=None)))
    return out


def _estimate_calls(fx: Any) -> list[Call]:
    import autoplan
    from autoplan import ParallelConfig
    g = fx.api["graph"]

    def est(config=None, **kw):
        full = {"global_batch_size": 8, "profile": None, **kw}
        return autoplan.estimate(g, "local:1", config=config or ParallelConfig(), **full)
    out = []
    for cfg in [dict(tp=0), dict(pp=0), dict(dp=0), dict(micro_batch_size=0),
                dict(micro_batch_size=3), dict(dp=2), dict(dp="1"), dict(virtual_stages=0),
                dict(num_microbatches=0), dict(dp=10 ** 400)]:
        out.append((f"estimate(graph, config=ParallelConfig({_r(cfg)}))",
                    lambda cfg=cfg: est(ParallelConfig(**cfg))))
    for kw in [dict(config=3), dict(global_batch_size=10 ** 12),
               dict(global_batch_size=10 ** 400), dict(memory_margin_bytes="x"),
               dict(memory_margin_bytes=float("nan")), dict(sharding=3),
               dict(simulate_pipeline="x"), dict(expert_capacity_factor=float("nan")),
               dict(profile=3), dict(example_inputs=3)]:
        out.append((f"estimate(graph, {_r(kw)})", lambda kw=kw: est(**kw)))
    out.append(("estimate(graph, 'local:2', pp=2 and 8,388,608 micro-batches)",
                lambda: autoplan.estimate(g, "local:2", config=ParallelConfig(pp=2),
                                          profile=None, global_batch_size=2 ** 23)))
    return out


def _compile_calls(fx: Any) -> list[Call]:
    import torch

    from autoplan.runtime.trainer import compile as compile_
    a = fx.api

    def comp(**kw):
        full = dict(example_inputs=(a["x"],), example_targets=a["y"], loss_fn=a["loss_fn"],
                    global_batch_size=8, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    plan=a["plan"])
        return compile_(a["model"], "local", **{**full, **kw})
    cases = [dict(plan=3), dict(plan=[fx.plan]), dict(plan={"config": {}}), dict(plan=b"\0"),
             dict(plan=fx.binary), dict(plan=fx.folder), dict(plan="a\0b"), dict(plan=fx.graph),
             dict(global_batch_size=0), dict(global_batch_size=16), dict(optimizer=3),
             dict(example_inputs=None), dict(example_inputs=3), dict(max_grad_norm=-1),
             dict(max_grad_norm="x"), dict(precision="fp8"), dict(plan=None, top_k="a"),
             dict(plan=None, force={"bogus": 1})]
    return [(f"compile(model, 'local', {_r(kw)})", lambda kw=kw: comp(**kw)) for kw in cases]


def step_calls(fx: Any) -> list[Call]:
    """``Trainer.step`` with batches that are not (inputs..., targets) of the traced kinds."""
    import torch
    t = _trainer(fx)
    x8, y8 = torch.randn(8, 8), torch.randint(0, 4, (8,))
    batches = {
        "None": None, "()": (), "[]": [], "x alone": x8, "(x,)": (x8,),
        "(x, y, y)": (x8, y8, y8), "(y, x) swapped": (y8, x8),
        "x of 7 rows": (x8[:7], y8[:7]), "x of 16 rows": (torch.randn(16, 8), y8),
        "targets of 7 rows": (x8, y8[:7]), "x (8, 9)": (torch.randn(8, 9), y8),
        "x (8, 8, 1)": (x8[..., None], y8), "x (8,)": (x8[:, 0], y8),
        "0-d x": (torch.tensor(1.0), y8), "x float64": (x8.double(), y8),
        "x int64": (x8.long(), y8), "targets float": (x8, y8.float()),
        "x bfloat16": (x8.bfloat16(), y8), "meta x": (x8.to("meta"), y8),
        "meta targets": (x8, y8.to("meta")), "x as a list": (x8.tolist(), y8),
        "x as a number": (3, y8), "a dict": {"x": x8, "y": y8}, "a string": "batch",
        "(None, y)": (None, y8), "sparse x": (x8.to_sparse(), y8),
        "a generator": (v for v in (x8, y8)), "nested": ((x8,), y8),
    }
    return [(f"Trainer.step({name})", lambda b=b: t.step(b)) for name, b in batches.items()]


_TRAINER: list[Any] = []


def _trainer(fx: Any) -> Any:
    """A one-process trainer of the fixtures' model and plan (built once)."""
    import torch

    from autoplan.runtime.trainer import compile as compile_
    if not _TRAINER:
        a = fx.api
        _TRAINER.append(compile_(a["model"], "local", example_inputs=(a["x"],),
                                 example_targets=a["y"], loss_fn=a["loss_fn"],
                                 global_batch_size=8, plan=a["plan"],
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01)))
    return _TRAINER[0]


def _r(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
