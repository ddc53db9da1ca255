"""Private implementation of jaxpr_surgery; import from the public modules."""
