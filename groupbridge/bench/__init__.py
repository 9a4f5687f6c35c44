"""The benchmark harness behind ``groupbridge bench``: every figure is measured beside its anchors."""
