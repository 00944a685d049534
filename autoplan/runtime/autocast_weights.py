"""Weights FSDP gathers in 16 bits, read where the program reads them as autocast would.

Under a 16-bit autocast plan with FSDP2 (ZeRO-2/3), ``MixedPrecisionPolicy(param_dtype=16-bit)``
gathers every weight in 16 bits (half the bytes; torchtitan's mixed precision). The rank
program is the model exported under ``torch.autocast`` and runs under it, so a product
(``linear``, ``matmul``, ``conv``, ...) casts its weight to 16 bits anyway: a 16-bit gathered
weight is exactly what it would read. Every other read of a weight is fp32 under autocast: an
embedding table, a norm's scale, a bias added outside a product. Fed a 16-bit weight, those ops
compute in 16 bits and everything after them follows: the embedding output, hence the whole
residual stream, in bf16 instead of fp32. A dense model hardly shows it; a mixture of experts
does (its router flips experts on the difference): HF Qwen3-MoE under dp2 ZeRO-2 in bf16 ended
twice as far from fp32 training as one process under autocast.

So, under autocast, FSDP's layer units leave their inputs as they come
(``cast_forward_inputs=False``: the residual stream stays fp32, autocast casts what runs in 16
bits), the weights outside the layers are gathered in fp32 where an embedding table is among
them (``graph.analysis.reads_tables``: a 16-bit table rounds the residual stream's start,
which alone took Qwen3-MoE twice as far), and ``read_as_autocast`` puts the layers' other fp32 reads back in
fp32: the weight cast to fp32 before an op that reads it so (norm scales, biases: small; a
Gemma norm's ``1 + weight`` is not rounded to 16 bits), and after an embedding its output (the
rows it read, never the table). What remains from eager autocast is the 16-bit rounding of the
layers' norm scales (measured harmless) and FSDP's 16-bit gradients before its fp32 reduction.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from autoplan.graph.opgraph import OpGraph
from autoplan.runtime.program import OP

# ops autocast runs in 16 bits, casting their weights (torch's lower-precision lists)
_PRODUCTS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "conv1d", "conv2d", "conv3d",
    "convolution", "_convolution", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "scaled_dot_product_attention", "linalg_vecdot"})
# (not grouped products: autocast has no kernel for them, cost/dtypes.UNCAST_PRODUCTS)
_CUDA_PRODUCTS = frozenset({"einsum", "mv", "addmv", "addr", "chain_matmul",
                            "linalg_multi_dot"})
# ops that move a weight's values without computing on them: what reads their output counts
_MOVES = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze",
    "squeeze", "select", "slice", "index", "index_select", "split", "split_with_sizes",
    "chunk", "unbind", "clone", "contiguous", "alias", "detach", "as_strided", "narrow",
    "unflatten", "flatten", "getitem"})
_GATHERS = frozenset({"embedding"})      # rows of the weight: their output is cast instead


def _kind(node: fx.Node, graph: OpGraph) -> str:
    """The aten name of what ``node`` runs ("linear"), through a strategy's kernel wrapper."""
    t = node.target
    if t is operator.getitem:
        return "getitem"
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    i = node.meta.get(OP)
    if i is not None and node.op == "call_function":
        return _aten_name(graph.ops[i].target)
    return ""


def _aten_name(target: str) -> str:
    """"linear" of an OpGraph op's "aten.linear.default"; another namespace's target whole."""
    return target.split(".")[1] if target.startswith("aten.") else target


def _reads_16bit(node: fx.Node, graph: OpGraph, products: frozenset[str]) -> bool:
    """Every path from ``node`` (a read of a weight) ends in a product autocast casts."""
    kind = _kind(node, graph)
    if kind in products:
        return True
    if kind in _MOVES:
        return bool(node.users) and all(_reads_16bit(u, graph, products) for u in node.users)
    return False


def read_as_autocast(gm: fx.GraphModule, graph: OpGraph, device: torch.device) -> int:
    """Cast the fp32 reads of ``gm``'s floating weights (see the module's docstring); returns
    how many reads were cast. On fp32 weights (those FSDP leaves whole) the casts are no-ops."""
    products = _PRODUCTS | (_CUDA_PRODUCTS if device.type == "cuda" else frozenset())
    g, cast = gm.graph, 0
    for node in list(g.nodes):
        if node.op != "get_attr" or not _is_floating_weight(gm, node.target):
            continue
        for user in list(node.users):
            if _reads_16bit(user, graph, products):
                continue
            if _kind(user, graph) in _GATHERS:
                with g.inserting_after(user):
                    up = g.call_function(torch.ops.aten.to.dtype, (user, torch.float32))
                user.replace_all_uses_with(up, delete_user_cb=lambda n, up=up: n is not up)
            else:
                with g.inserting_before(user):
                    up = g.call_function(torch.ops.aten.to.dtype, (node, torch.float32))
                user.replace_input_with(node, up)
            if OP in user.meta:
                up.meta[OP] = user.meta[OP]
            cast += 1
    if cast:
        gm.recompile()
    return cast


def _is_floating_weight(gm: fx.GraphModule, target: Any) -> bool:
    try:
        return gm.get_parameter(str(target)).is_floating_point()
    except AttributeError:          # a buffer, a constant, a process-group slot
        return False


__all__ = ["read_as_autocast"]
