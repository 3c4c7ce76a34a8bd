"""OpenAI's Responses API (``POST /v1/responses``), stateless, on top of chat completions.

A Responses request is validated here (:mod:`router.responses.request`), translated into the
:class:`~router.schemas.ChatRequest` the chat path already serves (templates, tools, structured
output, sampling, logprobs, limits), dispatched through the same relay (retries, migration,
stop-string hold-back, UTF-8 safety), and its events shaped into Response output items
(:mod:`router.responses.output`), a ``response`` object (:mod:`router.responses.shaping`) and,
streamed, the Responses event stream (:mod:`router.responses.stream`). Nothing is stored.
"""
