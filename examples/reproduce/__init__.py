"""Reproduction of the two optimizer findings of Roulet & Agarwala (arXiv 2510.00236).

    python -m examples.reproduce [--quick] [--out DIR] [--experiments sign adam batch] [files ...]

A small decoder-only byte-level transformer LM is trained on the Python
standard library's own source (or on the text files given), and

* ``sign``: the four placements of ``sign`` in the chain per-example gradients
  -> batch mean -> EMA -> update (``per_example_sign_sgd``, ``sign_sgd``,
  ``ema_of_sign``, ``sign_ema``) are compared over a learning-rate sweep, with
  the gradient SNR measured at each placement during training;
* ``adam``: ``adam`` vs ``micro_adam`` vs ``micro_adam_var`` vs
  ``micro_adam_msq`` over a learning-rate sweep, with and without clipping of
  the update;
* ``batch``: the same four across batch sizes with the square-root
  learning-rate rule (``sqrt_batch_size_scaling``).

Every training step is one ``js.value_and_per_example_stat`` call with the
optimizer's ``stat_request`` and one ``opt.update``, jitted together.
See ``docs/results.md`` for the results of the default run.
"""
