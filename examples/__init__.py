"""Examples of jaxpr_surgery (importable so that ``python -m examples.reproduce`` works)."""
