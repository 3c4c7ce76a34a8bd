"""The files ``llamadeploy up`` refuses, one list for every command that must refuse them alike.

``FILE_REFUSALS``: deploy.yaml documents the configuration itself refuses (``parse_config``),
each with the one line ``up``, ``plan``, ``doctor`` and ``apply`` print for it (after the file's
name). ``ADMIT_REFUSALS``: changes to one CPU replica of SmolLM2-135M on 2 cores that read well
but cannot run (:func:`launcher.plan.admit.admit`, ``up``'s check before anything starts), each
with a phrase of ``up``'s message; ``machine_free`` marks those refused on any machine (an e2e
apply can use them whatever the cores).
"""

from __future__ import annotations

FILE_REFUSALS = [
    ({"workers": {"max_num_seq": 4}}, "workers.max_num_seq: unknown key (did you mean 'max_num_seqs'?)"),
    ({"modle": {}}, "modle: unknown key (did you mean 'model'?)"),
    (
        {"workers": {"replicas": "2"}},
        "workers.replicas: a number is needed, not the string '2' (remove the quotes)",
    ),
    ({"router": {"port": "8000"}}, "router.port: a number is needed, not the string '8000' (remove the quotes)"),
    ({"workers": {"replicas": 0}}, "workers.replicas: replicas must be >= 1 or 'auto' (got 0)"),
    ({"model": 3}, "model: a section is needed: a mapping of its keys (or the model's name) (got 3)"),
    (
        {"router": {"port": 18600, "admin_port": 18600}},
        "router: port and admin_port are both 18600: the public API and the admin API need different ports; "
        "change one of them",
    ),
    (
        {"workers": {"tensor_parallel_size": 2, "gpus_per_replica": 2}},
        "workers: workers.tensor_parallel_size=2 and workers.gpus_per_replica=2 are exclusive "
        "(tensor parallel or a layer split): set one of them to 1",
    ),
    (
        {"cluster": {"backend": "ray"}, "workers": {"tensor_parallel_size": 2}},
        "workers.tensor_parallel_size > 1 is not supported with cluster.backend: ray yet; "
        "set workers.tensor_parallel_size: 1 or cluster.backend: local",
    ),
]

ADMIT_REFUSALS = [  # (sections changed, a phrase of up's message, refused on any machine)
    ({"workers": {"kv_cache_gib": 0.001}}, "raise workers.kv_cache_gib", True),
    ({"workers": {"tensor_parallel_size": 2}}, "does not divide the model's 9 attention heads", True),
    ({"workers": {"replicas": 3}}, "workers:", False),  # 3 replicas on 2 cores
    ({"model": {"max_model_len": 1_000_000}}, "max_model_len", True),
]


def case_id(case: tuple) -> str:
    """A test id for a case: its keys, dotted."""
    keys = [f"{s}.{k}" for s, v in case[0].items() for k in (v if isinstance(v, dict) and v else [""])]
    return ",".join(k.rstrip(".") for k in keys)
