"""Routing policies: which ready worker gets the next request.

One file per policy, each a class that implements :class:`router.policies.base.Policy` and owns
whatever state it keeps (the cache-aware policies their own prefix-affinity table). Adding a
policy is one new file here plus one line in :mod:`router.policies.registry`; the worker pool
(:mod:`router.routing`) only filters the candidates (ready, with room, of the request's model),
asks the policy, and tells it what happened (a request dispatched or finished, a worker gone).
"""
