"""ctrl's SQL store: the only source of truth for the cluster."""
