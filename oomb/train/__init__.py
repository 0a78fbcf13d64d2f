"""Training around the engine: the optimizers (:mod:`oomb.train.optim`)."""
