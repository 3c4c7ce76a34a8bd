"""``POST /v1/embeddings``: the request (:mod:`.request`), the model it names (:mod:`.model`), the
worker round trip (:mod:`.dispatch`) and the answer (:mod:`.api`)."""
