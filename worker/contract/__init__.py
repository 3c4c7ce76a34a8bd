"""What the worker shares with the router and the launcher, torch-free and self-contained.

The wire protocol (``protocol``), the worker's settings (``settings``), the environment names the
launcher sets (``env``), CURVE key files (``keys``), logging and lifeline set-up (``logs``,
``lifeline``), model-shape arithmetic (``shapes``), the KV budget rule (``budget``), dtype and
tensor-parallel shard rules (``dtypes``, ``tp_rules``, ``llama_family``), what a worker loads
(``load_plan``), byte units (``units``) and the grammar compile the router checks requests with
(``grammar``). Modules here import nothing of the project outside this package
(``tests/unit/test_layers.py`` checks it); this is the only part of ``worker`` the router imports.
"""
