"""Examples of jaxpr_surgery (importable so that ``python -m examples.reproduce`` works)."""

import os

# A smoke run (``--quick``) is mostly XLA compiling: a lower CPU optimisation level
# compiles about 1.6x faster. Set ``XLA_FLAGS`` to override.
QUICK_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def quick_xla_flags(quick: bool) -> None:
    """With ``quick``, `QUICK_XLA_FLAGS` unless ``XLA_FLAGS`` is set: call before the
    first computation (jax reads the flags when it starts its CPU backend, not at import)."""
    if quick and "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = QUICK_XLA_FLAGS
