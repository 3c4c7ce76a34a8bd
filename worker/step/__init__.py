"""The decode step without per-operation Python: fused CPU operators (:mod:`worker.step.fused`), the
plan of which steps they serve (:mod:`worker.step.plan`) and the fused forward (:mod:`worker.step.decode`)."""
