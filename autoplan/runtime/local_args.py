"""An op's arguments made local as the rank program copies it: tensor inputs replaced by this
rank's nodes (in the order ``graph/trace.py`` reads them), devices by this rank's, and shape
arguments written with global sizes rewritten to this rank's (``view(b, s, 16, 64)`` becomes
``view(b, s, 8, 64)`` on 2 ranks); and which output of a many-output node is which."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from autoplan.errors import PlanError
from autoplan.graph.opgraph import Op, OpGraph
from autoplan.sharding.strategy import opname

SHAPE_ARG = {"view": 1, "_unsafe_view": 1, "reshape": 1, "expand": 1}


def map_tensors(args: Any, kwargs: dict, fn: Callable[[fx.Node], Any]) -> tuple[Any, dict]:
    """(args as a list, kwargs) with every node, nested in lists and tuples too, replaced by
    ``fn(node)``, in the order trace.py reads tensor inputs."""
    def walk(a):
        if isinstance(a, fx.Node):
            return fn(a)
        if isinstance(a, (list, tuple)):
            return type(a)(walk(x) for x in a)
        return a
    new_args = walk(list(args))
    new_kwargs = {k: walk(v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def map_devices(a: Any, device: torch.device) -> Any:
    """``a`` with every device argument, nested too, replaced by ``device``."""
    if isinstance(a, torch.device):
        return device
    if isinstance(a, (list, tuple)):
        return type(a)(map_devices(x, device) for x in a)
    if isinstance(a, dict):
        return {k: map_devices(v, device) for k, v in a.items()}
    return a


def has_many_outputs(node: fx.Node) -> bool:
    """Whether ``node`` returns a tuple or list (its outputs are read by ``getitem``)."""
    return isinstance(node.meta.get("val"), (tuple, list))


def output_index(node: fx.Node, value_name: str) -> int:
    """The position of output ``value_name`` in what ``node`` returns."""
    for u in node.users:
        if u.target is operator.getitem and u.name == value_name:
            return int(u.args[1])
    raise PlanError(f"op {node.name}: no output {value_name}")


def local_shape_args(op: Op, graph: OpGraph, args: list, local_outs: list) -> list:
    """Shape arguments written with global sizes, rewritten to this rank's sizes."""
    name = opname(op)
    glob = [graph.value(n).meta.shape for n in op.outputs]
    if all(tuple(a) == tuple(b) for a, b in zip(glob, local_outs)):
        return args
    args = list(args)
    if name in SHAPE_ARG:
        args[SHAPE_ARG[name]] = list(local_outs[0])
        return args
    x = graph.value(op.inputs[0]).meta.shape
    if name == "split":
        axis = (args[2] if len(args) > 2 else 0) % len(x)
        args[1] = local_outs[0][axis]
    elif name == "split_with_sizes":
        axis = (args[2] if len(args) > 2 else 0) % len(x)
        args[1] = [o[axis] for o in local_outs]
    elif name == "unflatten":
        axis = args[1] % len(x)
        args[2] = list(local_outs[0][axis:axis + len(args[2])])
    return args


__all__ = ["SHAPE_ARG", "has_many_outputs", "local_shape_args", "map_devices", "map_tensors",
           "output_index"]
