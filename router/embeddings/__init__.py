"""``POST /v1/embeddings``: the request (:mod:`.request`), the
worker round trip (:mod:`.dispatch`) and the answer (:mod:`.api`)."""
