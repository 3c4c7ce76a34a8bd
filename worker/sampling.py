"""Sampling for a batch of sequences: one batched pass over ``[B, V]`` logits per engine step.

Each row keeps its own state in a :class:`RowSampler` (built once per sequence with
:meth:`RowSampler.from_params`); :func:`sample_batch_ex` (or :func:`sample_batch`, its token ids
only) processes every row of a step together, in this order (vLLM's and HF's order):

1. rows whose raw logits hold NaN or +inf are set aside as *bad rows* (:class:`SampleResult`);
2. HF ``repetition_penalty`` over prompt + output tokens (positive logits divided by it, negative
   ones multiplied), then OpenAI ``frequency_penalty`` × the token's count in the output and
   ``presence_penalty`` × (count > 0), both over generated tokens only, subtracted;
3. ``logit_bias`` added (a bias of -100 or less bans the token outright: ``-inf``);
4. ``min_tokens``: the stop tokens are masked while fewer tokens than that were generated (not on
   grammar-constrained rows, whose grammar decides when the value ends);
5. the grammar's token bitmask (xgrammar, :mod:`worker.grammar`);
6. log-probabilities, for rows that asked: ``log_softmax`` of the logits after 2-5 at temperature
   1 (what vLLM calls processed logprobs), a masked token reported as ``LOGPROB_FLOOR``;
7. greedy rows (temperature below ``GREEDY_BELOW``) take the argmax (a step whose rows are all
   greedy, without steps 2-6, is one ``max`` over the raw logits and nothing else); the others are divided by
   their temperature, cut to top-k then top-p (one descending sort shared by both; top-p keeps the
   smallest set of tokens whose probability reaches ``top_p``, Holtzman et al. 2019, as
   transformers' ``TopPLogitsWarper``), and sampled by an exponential race:
   ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per token, which picks token ``i`` with
   probability ``p_i`` (the Gumbel-max trick in another form; vLLM samples the same way).

Randomness. An unseeded row draws ``E`` from one batched ``exponential_`` over all unseeded rows.
A seeded row draws its ``E`` from a ``torch.Generator`` seeded with
``mix(seed, position) = splitmix64((seed mod 2**64) XOR splitmix64(position)) mod 2**63``, where
``position`` is the index of the token being sampled in the output (0 for the first generated
token). So a seeded row's token at position ``t`` depends only on its logits, its parameters,
``seed`` and ``t``: not on what shares the batch, nor on whether the request was preempted or
migrated and resumed with its earlier output (``from_params(..., output=...)`` sets the position).

All results come back with one device-to-host transfer (``.tolist()``) per step.

Bad rows. A row whose raw logits hold NaN or +inf, or whose masks leave no token (a grammar in a
dead end, every token banned by ``logit_bias``), gets token id ``BAD_TOKEN`` (-1) and an entry in
``SampleResult.bad_rows`` (row index -> reason); the other rows are sampled normally. The engine
must fail those requests (``Failed(code=500, message=reason)``) without appending the token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from worker.contract.protocol import LOGPROB_FLOOR, SamplingParams, TokenLogprob

# Below this a temperature means greedy, as in vLLM (_SAMPLING_EPS): dividing logits by 1e-300
# overflows to inf and breaks the softmax.
GREEDY_BELOW = 1e-5
BAN_BELOW = -100.0  # a logit_bias at or below this removes the token (OpenAI: "-100 should ban")
BAD_TOKEN = -1
MAX_TOP_LOGPROBS = 20
_M64 = (1 << 64) - 1
NOT_FINITE = "the model's logits are not finite (NaN or +inf)"
NOTHING_ALLOWED = "no token is allowed (logit_bias, min_tokens or the grammar masked every token)"


class SamplingError(ValueError):
    """Parameters the sampler cannot honour (a ``logit_bias`` id outside the vocabulary, no grammar
    support in this worker); the engine answers ``Failed(code=400)``."""


def splitmix64(x: int) -> int:
    """Sebastiano Vigna's SplitMix64 finalizer: a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed for output position ``position`` of a request seeded with ``seed``."""
    return splitmix64((seed & _M64) ^ splitmix64(position)) >> 1


class RowSampler:
    """Sampling state of one sequence.

    ``RowSampler(temperature, top_p, top_k, seed, device)`` is the plain form (no penalties, bias,
    grammar or logprobs); :meth:`from_params` builds the full one. After each sampled token the
    engine calls :meth:`accept` (position, penalty counts, grammar matcher), before
    ``Sequence.append``.
    """

    def __init__(
        self,
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None,
        device: torch.device,
        vocab_size: int | None = None,
    ):
        self.temperature = 0.0 if temperature < GREEDY_BELOW else temperature
        self.top_p = top_p
        self.top_k = top_k
        self.seed = seed
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.position = 0  # index in the output of the next token to sample
        self.presence = self.frequency = 0.0
        self.repetition = 1.0
        self.counts: torch.Tensor | None = None  # [V] float32, generated-token counts (penalised rows only)
        self.seen: torch.Tensor | None = None  # [V] bool, prompt + output tokens (repetition_penalty only)
        self.bias: torch.Tensor | None = None  # [V] float32 additive bias (-inf = banned)
        self.min_tokens = 0
        self.stop_ids: list[int] = []
        self.grammar = None  # worker.grammar.RowGrammar
        self.logprobs: int | None = None  # None: off; k: sampled token + top k
        # Report the stop token that ends the output too (echo requests: vLLM's shape, one entry per
        # token after the prompt, which lm-evaluation-harness's scoring counts on)
        self.stop_logprob = False
        self.pending_logprobs: list[TokenLogprob] = []
        self._last: TokenLogprob | None = None  # the logprob of the token sampled last, until accepted

    @classmethod
    def from_params(
        cls,
        params: SamplingParams,
        device,
        vocab_size: int,
        prompt: list[int],
        output: list[int] = (),
        eos_ids: Iterable[int] = (),
    ) -> RowSampler:
        """The sampler of one request. ``vocab_size`` is the width of the model's logits;
        ``eos_ids`` the ids that end a sequence (what ``min_tokens`` masks); ``output`` the tokens an
        earlier attempt already generated (a resumed request), replayed into the penalty counts and
        the grammar matcher and setting the seeded position. Raises :class:`SamplingError`."""
        s = cls(params.temperature, params.top_p, params.top_k, params.seed, device, vocab_size)
        s.presence, s.frequency = params.presence_penalty, params.frequency_penalty
        s.repetition = params.repetition_penalty
        if s.presence or s.frequency:
            s.counts = torch.zeros(vocab_size, dtype=torch.float32, device=s.device)
        if s.repetition != 1.0:
            s.seen = torch.zeros(vocab_size, dtype=torch.bool, device=s.device)
            if prompt:
                s.seen[torch.tensor(prompt, dtype=torch.long, device=s.device)] = True
        if params.logit_bias:
            ids = list(params.logit_bias)
            if any(not 0 <= t < vocab_size for t in ids):
                raise SamplingError(f"logit_bias token ids must be in [0, {vocab_size})")
            vals = [float("-inf") if v <= BAN_BELOW else float(v) for v in params.logit_bias.values()]
            s.bias = torch.zeros(vocab_size, dtype=torch.float32, device=s.device)
            s.bias[torch.tensor(ids, dtype=torch.long, device=s.device)] = torch.tensor(vals, device=s.device)
        s.stop_ids = sorted(set(eos_ids)) if not params.ignore_eos else []
        s.min_tokens = params.min_tokens
        if params.logprobs is not None:
            s.logprobs = max(0, min(int(params.logprobs), MAX_TOP_LOGPROBS))
        s.stop_logprob = params.prompt_logprobs is not None
        if params.grammar is not None:
            from worker.contract.grammar import GrammarError
            from worker.grammar import grammars

            try:
                s.grammar = grammars().matcher(params.grammar)
            except GrammarError as exc:
                raise SamplingError(str(exc)) from None
        for t in output:  # a resumed request: the state the undisturbed run would have reached
            s._last = None
            s.accept(t)
        s.pending_logprobs.clear()
        return s

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def generator(self) -> torch.Generator | None:
        """The generator for the token at the current position (seeded rows only)."""
        if self.seed is None or self.greedy:
            return None
        g = torch.Generator(device=self.device)
        g.manual_seed(position_seed(self.seed, self.position))
        return g

    @property
    def plain(self) -> bool:
        """No logit processing before temperature/top-k/top-p."""
        return (
            self.counts is None
            and self.seen is None
            and self.bias is None
            and self.grammar is None
            and not self._blocks_stop
        )

    @property
    def _blocks_stop(self) -> bool:
        return self.position < self.min_tokens and bool(self.stop_ids) and self.grammar is None

    def accept(self, token_id: int) -> None:
        """Record the token sampled for this row (call once per token, before ``Sequence.append``)."""
        if self.counts is not None:
            self.counts[token_id] += 1
        if self.seen is not None:
            self.seen[token_id] = True
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if (
            self._last is not None
            and self._last.token_id == token_id
            and (self.stop_logprob or token_id not in self.stop_ids)
        ):
            self.pending_logprobs.append(self._last)
        self._last = None
        self.position += 1

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The logprobs of the tokens accepted since the last call (stop tokens excluded unless
        ``stop_logprob``), for the ``Tokens`` message being sent; ``None`` when this row did not
        ask for logprobs."""
        if self.logprobs is None:
            return None
        out, self.pending_logprobs = self.pending_logprobs, []
        return out

    def sample(self, logits: torch.Tensor) -> int:
        """One row alone: ``logits`` [V]. Returns the token id (``BAD_TOKEN`` if it cannot sample)."""
        return sample_batch(logits.unsqueeze(0), [self])[0]


@dataclass
class SampleResult:
    """One step's outcome: ``token_ids`` [B] (``BAD_TOKEN`` for a bad row), ``logprobs`` [B] (a
    :class:`TokenLogprob` for rows that asked, else ``None``; also kept on the row's sampler until
    :meth:`RowSampler.accept`), ``bad_rows``: row index -> why the row could not be sampled."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    bad_rows: dict[int, str] = field(default_factory=dict)


def sample_batch(logits: torch.Tensor, samplers: Sequence[RowSampler]) -> list[int]:
    """Sample one token per row of ``logits`` [B, V]; returns B token ids (``BAD_TOKEN`` for bad rows)."""
    return sample_batch_ex(logits, samplers).token_ids


@torch.inference_mode()
def sample_batch_ex(logits: torch.Tensor, samplers: Sequence[RowSampler]) -> SampleResult:
    """Sample one token per row of ``logits`` [B, V] (any float dtype, any device); see the module
    docstring for the order of operations. Does not change ``logits`` or advance the samplers."""
    if logits.shape[0] != len(samplers):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(samplers)} samplers")
    if all(s.greedy and s.logprobs is None and s.plain for s in samplers):
        return _greedy(logits, samplers)
    return _general(logits, samplers)


def _general(logits: torch.Tensor, samplers: Sequence[RowSampler]) -> SampleResult:
    """:func:`sample_batch_ex` for any rows: steps 1-7 of the module docstring."""
    B, V = logits.shape
    dev = logits.device
    x = logits.float().clone()
    total = x.sum(dim=-1)  # NaN or +inf anywhere in a row shows in its sum; -inf is a masked token, not an error
    finite = ~(torch.isnan(total) | (total == float("inf")))  # [B]
    x = torch.where(finite.unsqueeze(-1), x, torch.zeros((), device=dev))
    rows = range(B)
    _penalize(x, samplers)
    bad = _mask(x, samplers)

    # 6. logprobs (processed, temperature 1)
    want = [i for i in rows if samplers[i].logprobs is not None]
    k_top = max((samplers[i].logprobs for i in want), default=0)
    lp = torch.log_softmax(x[torch.tensor(want, device=dev)], dim=-1) if want else None

    # 7. choose
    temps = torch.tensor([s.temperature if not s.greedy else 1.0 for s in samplers], device=dev).unsqueeze(-1)
    top_val, best = row_max(x)
    tokens = best
    rand = [i for i in rows if not samplers[i].greedy]
    if rand:
        idx = torch.tensor(rand, device=dev)
        z = x / temps if len(rand) == B else x[idx] / temps[idx]
        ks = [samplers[i].top_k if 0 < samplers[i].top_k < V else 0 for i in rand]
        ps = [samplers[i].top_p for i in rand]
        chosen = _sample_rows(z, ks, ps, [samplers[i].generator for i in rand])
        tokens = tokens.index_copy(0, idx, chosen)

    # One transfer: [token, flag, chosen logprob, top values..., top ids...] per row.
    empty = top_val == float("-inf")  # the row's best is -inf: nothing allowed
    flag = (~finite).float() + 2.0 * (finite & empty).float()
    cols = [tokens.double().unsqueeze(-1), flag.double().unsqueeze(-1)]
    if want:
        widx = torch.tensor(want, device=dev)
        row_lp = torch.zeros(B, dtype=torch.float32, device=dev)
        row_lp[widx] = lp.gather(1, tokens[widx].unsqueeze(-1)).squeeze(-1)
        cols.append(row_lp.double().unsqueeze(-1))
        if k_top:
            vals, ids = torch.topk(lp, k_top, dim=-1)
            tv = torch.zeros(B, k_top, device=dev)
            ti = torch.zeros(B, k_top, dtype=torch.long, device=dev)
            tv[widx], ti[widx] = vals, ids
            cols += [tv.double(), ti.double()]
    packed = torch.cat(cols, dim=-1).tolist()

    return _unpack(packed, samplers, bad, k_top)


def _greedy(logits: torch.Tensor, samplers: Sequence[RowSampler]) -> SampleResult:
    """:func:`sample_batch_ex` where every row is greedy, plain and wants no logprobs: one ``max``
    over the raw logits [B, V] and one transfer. The same tokens as the general path (the same
    ``max`` over the same values); a bad row shows in its maximum (NaN or +inf: not finite; -inf:
    nothing allowed)."""
    top_val, best = row_max(logits.float())
    packed = torch.stack((best.double(), top_val.double()), dim=-1).tolist()
    token_ids: list[int] = []
    bad: dict[int, str] = {}
    for i, (tok, top) in enumerate(packed):
        samplers[i]._last = None
        if top != top or top == float("inf"):
            bad[i] = NOT_FINITE
        elif top == float("-inf"):
            bad[i] = NOTHING_ALLOWED
        token_ids.append(BAD_TOKEN if i in bad else int(tok))
    return SampleResult(token_ids, [None] * len(packed), bad)


CHUNK = 128  # row_max's chunk: a vocabulary is nearly always a multiple of it


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.max(x, dim=-1)`` of ``x`` [B, V]: each row's maximum and the index of its first
    occurrence (NaN counts as the maximum, as in ``torch.max``). On CPU in two levels: ``amax`` over
    chunks of :data:`CHUNK` (a vectorized reduction, where ``max(dim)`` tracks an index per element
    in a scalar loop), then ``max`` over the chunk maxima and within the first chunk that
    holds the row's maximum: the same values and indices."""
    B, V = x.shape
    if x.device.type != "cpu" or V % CHUNK or not x.is_contiguous():
        return torch.max(x, dim=-1)
    n = V // CHUNK
    chunks = x.view(B * n, CHUNK)
    _, which = torch.max(chunks.amax(-1).view(B, n), dim=-1)  # [B], the first chunk holding the maximum
    if B > 1:
        which = which + torch.arange(0, B * n, n, device=x.device)
    val, at = torch.max(chunks.index_select(0, which), dim=-1)
    return val, (which % n) * CHUNK + at


def _penalize(x: torch.Tensor, samplers: Sequence[RowSampler]) -> None:
    """Steps 2-3 in place on ``x`` [B, V]: repetition, frequency and presence penalties, logit_bias."""
    V, dev, rows = x.shape[1], x.device, range(x.shape[0])
    rep = [i for i in rows if samplers[i].seen is not None]
    if rep:
        idx = torch.tensor(rep, device=dev)
        seen = torch.stack([samplers[i].seen[:V] for i in rep])
        pen = torch.tensor([samplers[i].repetition for i in rep], device=dev).unsqueeze(-1)
        sub = x[idx]
        x[idx] = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)
    cnt = [i for i in rows if samplers[i].counts is not None]
    if cnt:
        idx = torch.tensor(cnt, device=dev)
        counts = torch.stack([samplers[i].counts[:V] for i in cnt])
        freq = torch.tensor([samplers[i].frequency for i in cnt], device=dev).unsqueeze(-1)
        pres = torch.tensor([samplers[i].presence for i in cnt], device=dev).unsqueeze(-1)
        x[idx] = x[idx] - freq * counts - pres * (counts > 0).float()
    bias = [i for i in rows if samplers[i].bias is not None]
    if bias:
        idx = torch.tensor(bias, device=dev)
        x[idx] = x[idx] + torch.stack([samplers[i].bias[:V] for i in bias])


def _mask(x: torch.Tensor, samplers: Sequence[RowSampler]) -> dict[int, str]:
    """Steps 4-5 in place on ``x`` [B, V]: min_tokens and grammar masks. Returns the rows whose
    grammar cannot go on (row -> reason)."""
    B, V = x.shape
    dev, rows = x.device, range(B)
    block = [(i, t) for i in rows if samplers[i]._blocks_stop for t in samplers[i].stop_ids if t < V]
    if block:
        r, c = zip(*block, strict=True)
        x[torch.tensor(r, device=dev), torch.tensor(c, device=dev)] = float("-inf")
    bad: dict[int, str] = {}
    gram = [i for i in rows if samplers[i].grammar is not None]
    if gram:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(B, V)
        for i in gram:
            g = samplers[i].grammar
            if not g.fill(bitmask, i):
                bad[i] = g.failed or "the grammar allows no further token"
        # Rows without a grammar keep the all-allowed mask the bitmask starts with: one pass over every
        # row costs ~0.02 ms for 8 x 49,152 on CPU, passing ``indices`` ~1.5 ms.
        xgr.apply_token_bitmask_inplace(x, bitmask if dev.type == "cpu" else bitmask.to(dev, non_blocking=True))
    return bad


def _unpack(packed: list[list[float]], samplers: Sequence[RowSampler], bad: dict[int, str], k_top: int) -> SampleResult:
    """The host-side rows ``[token, flag, chosen logprob, k_top values, k_top ids]`` into a result;
    sets each sampler's last logprob (kept until :meth:`RowSampler.accept`)."""
    token_ids: list[int] = []
    logprobs: list[TokenLogprob | None] = [None] * len(packed)
    for i, row in enumerate(packed):
        s = samplers[i]
        if row[1] == 1.0:
            bad[i] = NOT_FINITE
        elif row[1] == 2.0 and i not in bad:
            bad[i] = NOTHING_ALLOWED
        if i in bad:
            token_ids.append(BAD_TOKEN)
            s._last = None
            continue
        tok = int(row[0])
        token_ids.append(tok)
        if s.logprobs is not None:
            top = [(int(row[3 + k_top + k]), _finite(row[3 + k])) for k in range(s.logprobs)]
            logprobs[i] = TokenLogprob(token_id=tok, logprob=_finite(row[2]), top=top)
        s._last = logprobs[i]
    return SampleResult(token_ids, logprobs, bad)


def _finite(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


def _noise(rows: int, width: int, gens: list[torch.Generator | None], device) -> torch.Tensor:
    """Exp(1) noise [rows, width] as ``-log(U)``: a seeded row from its own generator, the others in
    one batched draw (``rand`` + ``log`` costs a sixth of ``exponential_`` on CPU)."""
    u = torch.empty(rows, width, device=device)
    free = [j for j, g in enumerate(gens) if g is None]
    if len(free) == rows:
        u.uniform_()
    elif free:
        u[torch.tensor(free, device=device)] = torch.rand(len(free), width, device=device)
    for j, g in enumerate(gens):
        if g is not None:
            u[j] = torch.rand(width, generator=g, device=device)
    return u.log_().neg_()


def _race(probs: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """``argmax(p / E)`` per row of ``probs`` [R, W]: index ``i`` with probability ``p_i``."""
    return torch.max(probs / _noise(*probs.shape, gens, probs.device), dim=-1).indices


CUT = 256  # on CPU, top-k/top-p rows first look among their 256 best tokens (topk, not a full sort)


def _sample_rows(z: torch.Tensor, ks: list[int], ps: list[float], gens: list[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row of tempered logits ``z`` [R, V] under top-k ``ks`` (0 = off) and
    top-p ``ps`` (1 = off). Returns ids [R].

    A full-vocabulary sort is slow on one CPU core (tens of ms for a batch), so on CPU a cut row with
    ``top_k`` ≤ :data:`CUT` looks among its ``CUT`` best tokens: exact whenever those hold at least
    ``top_p`` of its probability (the usual case); the other rows take the full sort. Which path a
    row takes, and the width of its noise, depend on its own logits and parameters only (seeded rows
    stay batch-independent).
    On GPU every cut row takes the full sort (fast there, and no host sync to decide).
    """
    R, V = z.shape
    dev = z.device
    out = torch.empty(R, dtype=torch.long, device=dev)
    cut = [j for j in range(R) if ks[j] or ps[j] < 1.0]
    whole = [j for j in range(R) if j not in set(cut)]
    if len(whole) == R:
        return _race(torch.softmax(z, dim=-1), gens)
    if whole:
        w = torch.tensor(whole, device=dev)
        out[w] = _race(torch.softmax(z[w], dim=-1), [gens[j] for j in whole])
    if not cut:
        return out
    K = min(V, CUT)  # the same width for every row: a seeded row's noise does not depend on the others' top_k
    if dev.type == "cpu" and K < V and (near := [j for j in cut if ks[j] <= K]):
        c = torch.tensor(near, device=dev)
        kc = torch.tensor([ks[j] for j in near], device=dev)
        pc = torch.tensor([ps[j] for j in near], device=dev)
        zc = z[c]
        far = [j for j in cut if ks[j] > K]  # a top_k beyond the cut: the full sort
        vals, ids = torch.topk(zc, K, dim=-1)  # sorted, best first
        ranks = torch.arange(K, device=dev).unsqueeze(0)
        vals = vals.masked_fill((kc.unsqueeze(-1) > 0) & (ranks >= kc.unsqueeze(-1)), float("-inf"))
        # probabilities relative to the row's whole (top-k cut) distribution
        lse = torch.where(kc > 0, torch.logsumexp(vals, dim=-1), torch.logsumexp(zc, dim=-1))
        probs = torch.exp(vals - lse.unsqueeze(-1))
        ok = (pc >= 1.0) & (kc > 0) | (probs.sum(dim=-1) >= pc * (1 - 1e-6))
        okl = ok.tolist()
        good = [j for j, o in enumerate(okl) if o]
        if good:
            g = torch.tensor(good, device=dev)
            pg = _nucleus(probs[g], pc[g])
            pick = _race(pg, [gens[near[j]] for j in good])
            out[c[g]] = ids[g].gather(1, pick.unsqueeze(-1)).squeeze(-1)
        cut = [near[j] for j, o in enumerate(okl) if not o] + far
        if not cut:
            return out
    c = torch.tensor(cut, device=dev)
    kc = torch.tensor([ks[j] for j in cut], device=dev)
    pc = torch.tensor([ps[j] for j in cut], device=dev)
    out[c] = _race(torch.softmax(_top_k_top_p(z[c], kc, pc), dim=-1), [gens[j] for j in cut])
    return out


def _nucleus(sorted_probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens after each row's top-``p`` set; ``sorted_probs`` [R, W] is best first."""
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # probability of the better-ranked tokens
    drop = (before > p.unsqueeze(-1)) & (p.unsqueeze(-1) < 1.0)
    drop[:, 0] = False  # the best token always stays
    return sorted_probs.masked_fill(drop, 0.0)


def _top_k_top_p(z: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Mask ``z`` [R, V] to each row's top ``k`` (0 = off) then its top-``p`` nucleus (1 = off)."""
    V = z.shape[-1]
    srt, order = torch.sort(z, dim=-1, descending=True)
    ranks = torch.arange(V, device=z.device).unsqueeze(0)
    kk = torch.where(k > 0, k, torch.full_like(k, V)).unsqueeze(-1)
    srt = srt.masked_fill(ranks >= kk, float("-inf"))
    probs = torch.softmax(srt, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability of the better-ranked tokens
    drop = (before > p.unsqueeze(-1)) & (p.unsqueeze(-1) < 1.0)
    drop[:, 0] = False  # the best token always stays
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(z).scatter_(-1, order, srt)
