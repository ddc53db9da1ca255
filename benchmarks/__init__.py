"""Benchmarks of ``jaxpr_surgery`` against ``jax.grad``, ``vmap(grad)`` and optax ``micro_grad``.

* ``python -m benchmarks.run [--quick] [--out benchmarks/results/NAME.json] [--regimes ...]``
  compiles every method, times them interleaved in one process and writes
  JSON + CSV (machine info, wall-time medians and ratios to ``jax.grad``, XLA
  FLOPs and temporary memory, compile times, the largest batch within a
  memory budget, a ``chunk_size`` memory curve, and the issue's targets).
* ``python -m benchmarks.plot [JSON ...]`` renders ``docs/img/bench_*.png`` and
  ``docs/benchmarks.md``.

``benchmarks.models`` holds the models (MLP, CNN, transformer LM in short /
long / large-vocabulary settings, scan-over-layers with remat). See the
docstring of ``benchmarks.run`` for the protocol and its caveats. The suite by
concern: ``regimes`` (models, batch sizes, which statistics each method runs),
``methods`` (the functions compared), ``protocol`` (compile, then time
interleaved), ``sweeps`` (largest batch within a budget, ``chunk_size`` curve,
tracing cost), ``targets`` (the issue's targets), ``output`` (machine info, JSON
and CSV); ``run`` is the command line.
"""
