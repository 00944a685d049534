"""The sharding-rule registry: which rule lists an op's strategies on one mesh axis.

Rules register beside their definition, as DTensor's ``@register_op_strategy(aten.mm.default)``
does:

    @register_op_strategy("layer_norm", "rms_norm", "batch_norm", "group_norm")
    def _norm(graph, op, t) -> list[OpStrategy]: ...

- ``register_op_strategy(*names)``: the rule of the ops with these overload packets (``opname``);
  it returns the op's strategies beside ``replicate`` (``[]``: none).
- ``register_fallback``: a rule for ops known by a property rather than a name (torch's
  pointwise tag, a view the dim maps know); fallbacks are tried in the order they register and
  return None for an op that is not theirs.

An op no rule claims is only replicated. ``strategies.py`` imports every rule module, so the
registry is complete once it is imported.

Kernels. A strategy whose sharded form is not the op on shards names a local kernel
(``OpStrategy.kernel``); each is declared here with ``declare_kernel`` beside the rule that
needs it, and the runtime registers its implementation under the same name
(``runtime/program_calls.register_kernel``). ``tests/test_rule_registry.py`` checks that the two
sets agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from autoplan.graph.opgraph import Op, OpGraph, opname

# a rule returns ``strategy.OpStrategy`` values (not named here: ``strategy`` reads this
# module's kernel names)
Rule = Callable[[OpGraph, Op, int], list[Any]]
Fallback = Callable[[OpGraph, Op, int], "list[Any] | None"]

_BY_NAME: dict[str, Rule] = {}
_FALLBACKS: list[Fallback] = []

# kernel name -> what the runtime runs on each rank ("": the op itself on local tensors)
_KERNELS: dict[str, str] = {"": "the op itself on the rank's local tensors"}
KERNELS: Mapping[str, str] = MappingProxyType(_KERNELS)


def register_op_strategy(*names: str) -> Callable[[Rule], Rule]:
    """Make the decorated function the strategy rule of the ops named ``names``."""
    def deco(rule: Rule) -> Rule:
        for n in names:
            if n in _BY_NAME:
                raise ValueError(f"op {n!r} has two sharding rules: {_BY_NAME[n].__qualname__} "
                                 f"and {rule.__qualname__}")
            _BY_NAME[n] = rule
        return rule
    return deco


def register_fallback(rule: Fallback) -> Fallback:
    """Try the decorated rule, after every earlier one, for ops no named rule claims."""
    _FALLBACKS.append(rule)
    return rule


def declare_kernel(name: str, what: str) -> str:
    """Declare local kernel ``name`` (``what``: what it runs on each rank); returns the name."""
    if _KERNELS.get(name, what) != what:
        raise ValueError(f"kernel {name!r} is declared twice")
    _KERNELS[name] = what
    return name


def rule_for(op: Op) -> Rule | None:
    """The named rule of ``op``, None where it has none (then the fallbacks decide)."""
    return _BY_NAME.get(opname(op))


def fallbacks() -> tuple[Fallback, ...]:
    return tuple(_FALLBACKS)


def named_ops() -> frozenset[str]:
    """Every op name a rule is registered for."""
    return frozenset(_BY_NAME)


__all__ = ["KERNELS", "Fallback", "Rule", "declare_kernel", "fallbacks", "named_ops",
           "register_fallback", "register_op_strategy", "rule_for"]
