"""Private implementation of `jaxpr_surgery.privacy`: ``accounting`` (epsilon of DP-SGD
through ``dp_accounting``, noise calibration), ``sampling`` (Poisson batches of a fixed
shape) and ``clipped_grad`` (jax-privacy's entry point on per-example statistics)."""
