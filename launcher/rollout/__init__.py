"""``llamadeploy apply``: changing a running deployment — the diff → plan function, revisions, the rollout."""
