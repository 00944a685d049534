"""The words an OpGraph is written in: the dtypes it knows (with their item sizes), the kinds of
its values, and the kinds of its ops (the rule families of ``oprules``).

They live apart from ``opgraph`` (the graph) and ``oprules`` (the rules) so that ``check`` (the
checker of graph files, which ``OpGraph.from_dict`` runs) reads them without importing either.
"""

from __future__ import annotations

ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn",
                          "float8_e5m2"})
VALUE_KINDS = ("input", "param", "buffer", "constant", "activation")
OP_KINDS = ("matmul", "conv", "attention", "embedding", "norm", "pointwise", "dropout", "view",
            "reduction", "loss", "pool", "creation", "copy", "other")
