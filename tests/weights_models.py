"""The test models live in the package (the benchmark uses them too)."""

from groupbridge.bench.models import (
    ALL_DTYPES,
    bit_equal,
    dense_shapes,
    every_dtype,
    make_model,
    moe_shapes,
    zeros_like_model,
)

__all__ = [
    "ALL_DTYPES",
    "bit_equal",
    "dense_shapes",
    "every_dtype",
    "make_model",
    "moe_shapes",
    "zeros_like_model",
]
