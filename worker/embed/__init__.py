"""The embedding worker: a sentence-transformers or decoder model that turns inputs into vectors
(:mod:`worker.embed.model`), batched across requests by tokens (:mod:`worker.embed.batcher`) in
an engine that speaks the same protocol and load reports as the chat engine
(:mod:`worker.embed.engine`)."""
