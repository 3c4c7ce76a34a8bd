"""``llamadeploy bench``: a benchmark for any OpenAI-compatible ``/v1`` server (ours or a peer's).

Installed with the ``[bench]`` extra (httpx, matplotlib); the server never imports it. One role per
module: :mod:`.options` (the run's options), :mod:`.prompts` (what is sent), :mod:`.client` (HTTP
and SSE), :mod:`.load` (load patterns), :mod:`.summary` (figures from timelines, pure),
:mod:`.figures` (the engine table, targets and comparisons, pure), :mod:`.engine_suite` and
:mod:`.load_suite` (the two suites), :mod:`.ceiling` (the in-process static batch),
:mod:`.report` and :mod:`.plot` (output), :mod:`.runner` (one run) and :mod:`.command` (the CLI);
:mod:`.perplexity` (llama-perplexity's arithmetic, pure) and :mod:`.perplexity_run` (``--perplexity``).
"""
