"""Wire messages between the router and its workers: the one definition both sides import.

Every message is a ``msgspec.Struct`` tagged by class name and encoded as msgpack. Decoding goes
through :func:`decode`, which checks the schema and raises :class:`ProtocolError` on anything
else, so a malformed or hostile frame never reaches the engine. Nothing is ever pickled.

Transport (ZeroMQ): the router binds a ROUTER socket; each worker connects a DEALER whose
identity is ``worker_identity(worker_id)`` (stable across restarts). Every frame is one message.

This module must stay import-light (no torch, no transformers): the router imports it.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 5  # bumped on every change of a message's fields (2: Heartbeat carries EngineLoad; 3: Embed;
# 4: Generate carries priority and flex; 5: EngineLoad counts captured and eager decode steps, Ready carries the
# system fingerprint)


class Msg(msgspec.Struct, tag=True, forbid_unknown_fields=True, array_like=False):
    """Base of all wire messages; the class name is the msgpack tag."""


# ---- worker -> router ---------------------------------------------------------------


class Hello(Msg):
    """First message after connecting (state ``starting``): who the worker is and its capacity.

    ``max_num_seqs`` caps its running batch; ``max_waiting`` bounds its queue.
    """

    protocol: int
    worker_id: int
    pid: int
    device: str
    model: str
    max_num_seqs: int
    max_waiting: int
    node_id: str = ""  # the cluster node it runs on ("" when local), :mod:`worker.node`
    node_ip: str = ""
    gpu_ids: str = ""  # GPU ids the cluster scheduler assigned


class KernelPick(msgspec.Struct, forbid_unknown_fields=True):
    """Steps of up to ``rows`` rows (the smallest bucket that holds them; beyond the last bucket,
    the last) run ``kernel``; ``ms`` is its measured time per call (None: the only eligible one,
    not timed)."""

    rows: int
    kernel: str
    ms: float | None = None


class KernelChoice(msgspec.Struct, forbid_unknown_fields=True):
    """The kernels the ``count`` linear weights of shape ``n`` × ``k`` (out × in) in format
    ``weight`` (``float32``, ``int8/channel``, ``int4/g32``, ``Q4_1/g32`` ...) run, measured at
    start (``worker.quant.autotune``)."""

    n: int
    k: int
    weight: str
    count: int
    picks: list[KernelPick] = []


class Ready(Msg):
    """Model loaded and warm-up generation done; ``load_seconds`` is wall time since start,
    ``kv_budget_tokens`` the KV-cache budget in tokens, ``weight_bytes`` the bytes of every weight
    tensor it holds (quantized forms and any second form of a weight included; the KV cache apart),
    ``kernels`` the kernel table it chose, ``fingerprint`` its ``system_fingerprint``
    (:mod:`worker.contract.fingerprint`; "" for an embedding model)."""

    worker_id: int
    load_seconds: float
    kv_budget_tokens: int
    visible_devices: str = ""
    gpu_uuids: list[str] = []  # the GPUs torch sees, in its cuda:N order
    block_size: int = 0  # tokens per KV block of its prefix cache (0: none); the router's cache-aware routing
    weight_bytes: int = 0
    kernels: list[KernelChoice] = []
    fingerprint: str = ""


class EngineLoad(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The engine's figures, the one home of each: :meth:`worker.engine.Engine.stats` fills it, the
    :class:`Heartbeat` carries it, the router's worker table (``router.admin_protocol.WorkerInfo``
    inherits these fields), ``/metrics`` and ``llamadeploy status`` read it. A new figure is one
    field here, with a default (what a worker that does not report it is taken to say).

    ``kv_used_tokens`` counts reserved worst-case tokens; ``mem_bytes`` is RSS on CPU and torch's
    reserved memory on GPU. Counters (``finished``, ``steps``, ``prefix_*``, ``preemptions``, ``*_steps``) run
    since the worker process started."""

    running: int = 0
    waiting: int = 0
    kv_used_tokens: int = 0
    mem_bytes: int = 0
    peak_running: int = 0
    finished: int = 0  # sequences the engine finished
    steps: int | None = None  # engine steps so far; None: the engine does not report it
    last_step_age_s: float | None = None  # seconds since the engine's last step (None: not reported)
    cpu_s: float | None = None  # CPU seconds its process has used, all threads (None: not reported)
    prefix_hit_tokens: int = 0  # prompt tokens found in the prefix cache
    prefix_queried_tokens: int = 0  # prompt tokens looked up in it
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    preemptions: int = 0
    captured_steps: int = 0  # engine steps run by the captured decode step (worker.step)
    eager_decode_steps: int = 0  # decode-only steps it could not serve, run eagerly (capture off, too many rows)
    compute_threads: int = 0  # threads a CPU worker's steps compute on now (worker.cpu_share); 0: not governed
    thread_changes: int = 0  # how often that count changed (the cores were taken by others, or given back)


class Heartbeat(Msg):
    """Periodic load report of worker ``worker_id``: its engine's :class:`EngineLoad` now."""

    worker_id: int
    load: EngineLoad


class Usage(msgspec.Struct, forbid_unknown_fields=True):
    """Token counts of one finished request, OpenAI's ``usage`` object."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


class TokenLogprob(msgspec.Struct, forbid_unknown_fields=True):
    """One sampled token's log-probability (natural log, floored at ``LOGPROB_FLOOR``) and, when
    asked, the ``top`` most likely alternatives as ``[token_id, logprob]`` pairs, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


LOGPROB_FLOOR = -9999.0  # what a log-probability of -inf (a masked token) is reported as: JSON has no -inf


class Tokens(Msg):
    """A streamed delta. ``finish_reason`` is ``"stop"`` or ``"length"`` on the last one only,
    which also carries ``usage``. ``text_delta`` is always whole UTF-8 characters."""

    request_id: str
    text_delta: str
    token_ids: list[int]
    finish_reason: str | None = None
    usage: Usage | None = None
    ttft_s: float | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token sampled since the last message, when asked
    # With params.prompt_logprobs, on the first message only: prompt tokens 1..P-1 (token 0 has none)
    prompt_logprobs: list[TokenLogprob] | None = None


class Failed(Msg):
    """The worker could not serve ``request_id``. ``code`` is an HTTP status (400, 429, 500, 503).

    ``retry_after_s`` is set when the worker refuses for lack of capacity (a full queue, a queue
    wait past its deadline, out of memory): the client should retry later (``Retry-After``). A 503
    without it means the worker is leaving with the request in flight (the router moves it)."""

    request_id: str
    code: int
    message: str
    retry_after_s: float | None = None


class Embedded(Msg):
    """Vectors of an :class:`Embed` request: inputs ``start`` .. ``start + len(vectors) - 1``, each
    as little-endian float32 bytes of the model's served width, in input order. A large answer
    comes in several messages (each under the link's frame limit); the one with ``last`` set also
    carries ``prompt_tokens``, the tokens of every input."""

    request_id: str
    start: int
    vectors: list[bytes]
    last: bool = True
    prompt_tokens: int = 0


class Bye(Msg):
    """The worker is leaving on purpose (shutdown or restart); sent before it exits."""

    worker_id: int
    reason: str


# ---- router -> worker ---------------------------------------------------------------


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True):
    """Per-request sampling. ``temperature == 0`` means greedy; ``top_k == 0`` means off."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # OpenAI: minus this from a token's logit once it was generated (-2..2)
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output (-2..2)
    repetition_penalty: float = 1.0  # HF: divide positive / multiply negative logits of prompt+output tokens (> 0)
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (-100..100; -100 bans it)
    min_tokens: int = 0  # the stop tokens are masked until this many tokens were generated
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and the top k alternatives'
    # None: off; k >= 0: every prompt token's logprob (raw: before penalties) and its top k, sent
    # once in the first Tokens message; a stop token that ends the output is then reported too
    prompt_logprobs: int | None = None
    grammar: Grammar | None = None  # constrain the output (worker.grammar)


class Grammar(msgspec.Struct, forbid_unknown_fields=True):
    """A decoding constraint, compiled by the worker (xgrammar). ``kind``: ``json_object`` (any JSON
    object; ``source`` unused), ``json_schema`` (``source`` = the schema as JSON, keys in the client's order; ``strict``:
    no properties beyond the schema's), ``regex`` or ``ebnf`` (``source`` = the pattern/grammar)."""

    kind: str
    source: str = ""
    strict: bool = True


class Generate(Msg):
    """Generate a continuation of ``prompt_token_ids`` (already templated and tokenized).

    ``http_request_id`` is the HTTP request's ``X-Request-ID``, for the worker's logs only.
    ``output_token_ids``: tokens an earlier attempt already generated (request migration). The
    worker takes prompt + output as context, replays the output through its detokenizer and stop
    matcher without sending that text again, generates ``params.max_tokens - len(output)`` more,
    and reports ``usage`` counting the prompt and all output once. ``priority`` and ``flex`` come
    from the request's ``priority`` and ``service_tier`` (the router maps them; the worker's
    scheduler honours them)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    http_request_id: str = ""
    output_token_ids: list[int] = []
    # vLLM's request priority: a lower value is scheduled first, ties in arrival order
    priority: int = 0
    # OpenAI's service_tier "flex": the request may wait; an interactive one may preempt it when the KV cache is full
    flex: bool = False


class Embed(Msg):
    """Embed each of ``inputs`` (token id lists, already tokenized and checked against the model's
    limits by the router) into one vector; answered by :class:`Embedded` or :class:`Failed`.
    ``http_request_id`` is for the worker's logs only."""

    request_id: str
    inputs: list[list[int]]
    http_request_id: str = ""


class Cancel(Msg):
    """Stop generating ``request_id`` and free its KV cache; no reply is sent."""

    request_id: str


class Shutdown(Msg):
    """Finish nothing further, send :class:`Bye` and exit with code 0."""

    reason: str = "shutdown"


WorkerToRouter = Hello | Ready | Heartbeat | Tokens | Embedded | Failed | Bye


class Identify(Msg):
    """Say :class:`Hello` again, and :class:`Ready` if loaded: the router (restarted) does not
    know this worker. The worker keeps its model and whatever it is generating."""


RouterToWorker = Generate | Embed | Cancel | Shutdown | Identify

_encoder = msgspec.msgpack.Encoder()
_to_router = msgspec.msgpack.Decoder(WorkerToRouter)
_to_worker = msgspec.msgpack.Decoder(RouterToWorker)


class ProtocolError(ValueError):
    """A frame that is not a valid message for this direction (wrong schema, garbage bytes)."""


def encode(msg: Msg) -> bytes:
    """Serialize one message to msgpack bytes."""
    return _encoder.encode(msg)


def decode_for_router(frame: bytes) -> WorkerToRouter:
    """Decode a worker's frame. Raises :class:`ProtocolError` on anything invalid."""
    try:
        return _to_router.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(str(exc)) from exc


def decode_for_worker(frame: bytes) -> RouterToWorker:
    """Decode a router's frame. Raises :class:`ProtocolError` on anything invalid."""
    try:
        return _to_worker.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(str(exc)) from exc


def worker_identity(worker_id: int) -> bytes:
    """ZeroMQ routing identity of worker slot ``worker_id`` (stable across restarts)."""
    return f"worker-{worker_id}".encode()
