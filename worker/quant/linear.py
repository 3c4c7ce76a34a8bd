"""The model's linear layers as the engine runs them: quantized at load when asked, each weight
multiplied by the kernel measured fastest for its shape and the step's row count.

:class:`Linears` is the ``linear`` factory :class:`worker.llama.LlamaModel` builds its layers
through (weight → callable). The first weight of each shape and format is tuned
(:func:`worker.quant.autotune.tune`); the others of that shape reuse its choice, so a 32-layer model
is measured on its five distinct shapes, not on 225 weights. It counts the bytes of every tensor the
chosen kernels hold (each storage once), which is the worker's weight memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from worker.contract import quant_rules as rules
from worker.contract.protocol import KernelChoice, KernelPick
from worker.quant import ggml_kernel, invariance
from worker.quant.autotune import Choice, Pick, buckets, invariant, tune, weight_label
from worker.quant.format import QuantizedWeight, quantize_int4, quantize_int8
from worker.quant.gguf_blocks import GROUP, unpack
from worker.quant.kernels import Candidate, Kernel, Weight, candidates, check, head_pool, storage_key

log = logging.getLogger(__name__)


def gather_rows(w: QuantizedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` [T] of a quantized table, dequantized: [T, K] float32."""
    t, (_, k), g = ids.shape[0], w.shape, w.group_size
    rows = F.embedding(ids, w.q).float().view(t, k // g, g) * F.embedding(ids, w.scale).unsqueeze(-1)
    if w.offset is not None:
        rows = rows + F.embedding(ids, w.offset).unsqueeze(-1)
    return rows.view(t, k)


Native = tuple[torch.dtype | None, Callable]


class Dispatch:
    """``x [T, K] -> [T, N]`` by the kernel of T's bucket: ``table[T]`` for T up to the last bucket,
    the last bucket's kernel beyond it (one list lookup per call). :meth:`native` gives the same
    kernel without its casts."""

    __slots__ = ("last", "natives", "table")

    def __init__(self, table: list[Callable], natives: list[Native]):
        self.table, self.last, self.natives = table, table[-1], natives

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        return (self.table[t] if t < len(self.table) else self.last)(x)

    def native(self, rows: int) -> Native:
        """The kernel for ``rows`` rows as ``(dtype, fn)``: ``fn`` takes and returns ``dtype`` and casts
        nothing (:attr:`worker.quant.kernels.Kernel.native`); ``dtype`` None: the caller's own (the
        kernel computes in it)."""
        return self.natives[rows] if rows < len(self.natives) else self.natives[-1]


class Single(Dispatch):
    """:class:`Dispatch` with one kernel for every row count."""

    __slots__ = ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(x)

    def native(self, rows: int) -> Native:
        return self.natives[0]


def row_by_row(table: list) -> tuple[int, int] | None:
    """``(weights that run a rowwise fallback, all weights)`` of a kernel table's ``(choice, count)``
    rows (:meth:`Linears.table`), or None when none does: on a GPU the fallback is there because no
    faster kernel passed the row-invariance check (:mod:`worker.quant.invariance`), and its step time
    grows with the rows."""
    slow = sum(count for choice, count in table if any(p.kernel.startswith("rowwise") for p in choice.picks))
    return (slow, sum(count for _, count in table)) if slow else None


class Linears:
    """Builds each linear layer's callable. ``quantization``: ``int8`` / ``int4`` quantize a float
    weight passed to :meth:`__call__` (:mod:`worker.contract.quant_rules`), and store the embedding table
    and the LM head (:meth:`embedding`, :meth:`head`) as int8 rows, one copy when they are tied;
    anything else leaves weights as they come (float, or a :class:`QuantizedWeight` read from a
    quantized file). ``max_rows``: the most rows a step can have (its decodes and prefill
    chunks); ``max_logit_rows``: the most rows the LM head sees (one per running sequence).
    ``allow_copies``: also consider float copies of quantized weights (off: quantization is for
    memory). ``timer``: the clock of the measurements (None: :func:`~worker.quant.autotune.measure`'s
    own; a fake one in tests). ``agree``: with tensor parallelism, maps this rank's picks (kernel
    indices per bucket) to rank 0's (:meth:`worker.tp.TPGroup.rank0_ints`), so every rank of a replica
    runs rank 0's table. ``shared``: a table shared by the replicas of a model
    (:func:`worker.quant.autotune.load_or_measure`): a weight found there runs its saved picks
    unmeasured, one measured here is added to it.
    ``deterministic``: only row-invariant kernels, one per weight for every bucket
    (:mod:`worker.quant.invariance`, whose fallbacks join the pool)."""

    def __init__(
        self,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str = "none",
        max_rows: int = 8,
        max_logit_rows: int = 8,
        allow_copies: bool = False,
        timer: Callable[[], float] | None = None,
        agree: Callable[[list[int]], list[int]] | None = None,
        shared: dict[str, list[Pick]] | None = None,
        deterministic: bool = False,
    ):
        self.device, self.dtype = device, dtype
        self.bits = rules.bits_of(quantization)
        self.rows, self.logit_rows = buckets(max_rows), buckets(max_logit_rows)
        self.allow_copies, self.timer, self.agree, self.shared = allow_copies, timer, agree, shared
        self.deterministic = deterministic
        extra = invariance.candidates(dtype, device) if deterministic else []
        self.pool = {c.name: c for c in candidates(dtype, device) + extra}
        self.rows8: dict[int, QuantizedWeight] = {}  # float table's storage -> its int8 rows
        self.gathers: dict[int, Callable] = {}  # a weight's storage -> rows read from a kernel's layout
        self.choices: dict[tuple, Choice] = {}
        self.counts: dict[tuple, int] = {}  # weights per choice
        self.held: dict[int, int] = {}  # storage key -> bytes: the weight memory
        self.seconds = 0.0  # spent tuning

    def __call__(self, weight: Weight) -> Callable:
        """A decoder layer's linear (fused qkv, o, gate_up, down): quantized first when asked."""
        return self._build(self.quantize(weight), self.rows, list(self.pool.values()))

    def head(self, weight: Weight) -> Callable:
        """The LM head, tuned for at most ``max_logit_rows`` rows: int8 rows when quantizing, else
        in the compute dtype; only kernels whose logits keep the compute dtype's precision
        (:func:`~worker.quant.kernels.full_precision`; float32 logits in a bfloat16 model where a kernel gives
        them, :func:`~worker.quant.kernels.head_pool`). Where its kernel holds the rows in a layout of
        its own, the per-row form is dropped and a tied embedding (:meth:`embedding`) reads that one."""
        held = self.rows_int8(weight)
        pool = head_pool(list(self.pool.values()), held, self.dtype, self.device)
        fn = self._build(held, self.logit_rows, pool)
        if held is not weight and storage_key(held.q) in self.gathers:
            self.rows8.pop(storage_key(weight))
            self.gathers[storage_key(weight)] = self.gathers[storage_key(held.q)]
        return fn

    def embedding(self, table: Weight) -> Callable[[torch.Tensor], torch.Tensor]:
        """``ids [T] -> [T, hidden]`` float32 rows of ``table`` [V, hidden] (int8 rows when
        quantizing: only the T rows asked for are dequantized). A table tied to an LM head built
        first (:meth:`head`) whose kernel re-laid it out is read from that layout: held once."""
        key = storage_key(table if isinstance(table, torch.Tensor) else table.q)
        if key in self.gathers:
            return self.gathers[key]  # its tensors were counted with the head's kernel
        table = self.rows_int8(table)
        self.rows8.pop(key, None)  # the tie is made
        if isinstance(table, torch.Tensor):
            self.count(table)
            return lambda ids: F.embedding(ids, table).float()
        for t in (table.q, table.scale, table.offset):
            self.count(t)
        return lambda ids: gather_rows(table, ids)

    def rows_int8(self, weight: Weight) -> Weight:
        """``weight`` as int8 with one scale per row when quantizing (the same object for the same
        float tensor: a tied embedding and LM head share it), else as it is."""
        if self.bits is None or isinstance(weight, QuantizedWeight):
            return weight
        key = storage_key(weight)
        if key not in self.rows8:
            self.rows8[key] = self._ggml_blocks(weight, "Q8_0") or quantize_int8(weight, weight.shape[1])
        return self.rows8[key]

    def quantize(self, weight: Weight) -> Weight:
        """``weight`` [N, K] as :mod:`worker.contract.quant_rules` cuts it, when a float weight is to be
        quantized; else (and where K holds no whole number of groups) as it is."""
        if self.bits is None or isinstance(weight, QuantizedWeight):
            return weight
        k = weight.shape[1]
        if ggml := self._ggml_blocks(weight, "Q8_0" if self.bits == 8 else "Q4_1"):
            return ggml
        group = rules.group_size(self.bits, k)
        if k % group:
            return weight  # no whole number of groups along K: left in the compute dtype (as sizing counts it)
        return (quantize_int8 if self.bits == 8 else quantize_int4)(weight, group)

    def _ggml_blocks(self, weight: torch.Tensor, type_name: str) -> QuantizedWeight | None:
        """``weight`` quantized by ggml into ``type_name`` blocks (``ggml_quantize_chunk``), held both as
        blocks (ggml's kernels) and unpacked (torch's), where ggml's kernels are candidates (on a CPU
        where they are loaded) and K holds whole blocks; else None (the torch-side rules of
        :mod:`worker.contract.quant_rules`)."""
        n, k = weight.shape
        ggml_type = ggml_kernel.TYPE_OF[type_name]
        if "ggml" not in self.pool or k % ggml_kernel.block_values(ggml_type):
            return None
        with torch.inference_mode():
            blocks = ggml_kernel.quantize(weight, type_name)
        bits, q, scale, offset = unpack(GGMLQuantizationType(ggml_type), blocks.numpy(), n, k)
        as_tensor = torch.from_numpy
        offset = None if offset is None else as_tensor(offset)
        return QuantizedWeight(bits, as_tensor(q), as_tensor(scale), offset, GROUP, type_name, blocks, ggml_type)

    def count(self, t: torch.Tensor | None) -> None:
        """Count a tensor the model holds outside its linears (embeddings, norms, biases)."""
        if t is not None:
            self.held.setdefault(storage_key(t), t.numel() * t.element_size())

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight tensor held, each storage once (second forms included)."""
        return sum(self.held.values())

    def _build(self, w: Weight, rows: list[int], pool: list[Candidate]) -> Callable:
        key = (tuple(w.shape), weight_label(w, self.dtype), tuple(rows), tuple(c.name for c in pool))
        choice = self.choices.get(key)
        if choice is None and (saved := self._saved(key, w, pool)) is not None:
            choice, kernels = saved
            self.choices[key] = choice
        elif choice is None:
            start = time.perf_counter()
            choice, built = tune(
                w, self.dtype, self.device, rows, self.allow_copies, self.timer, pool, self.deterministic
            )
            if self.agree is not None:
                choice = self._rank0s(choice, built, w, pool)
            self.seconds += time.perf_counter() - start
            self.choices[key] = choice
            if self.shared is not None:
                self.shared[repr(key)] = choice.picks
            kernels = {name: built[name] for name in choice.kernels()}
        else:
            with torch.inference_mode():
                kernels = {name: self._named(name, w) for name in choice.kernels()}
        self.counts[key] = self.counts.get(key, 0) + 1
        for kernel in kernels.values():
            if kernel.gather is not None:
                self.gathers.setdefault(storage_key(w.q if isinstance(w, QuantizedWeight) else w), kernel.gather)
            for t in kernel.held:
                self.held.setdefault(storage_key(t), t.numel() * t.element_size())
        return self.dispatch(choice.picks, kernels)

    def _saved(self, key: tuple, w: Weight, pool: list[Candidate]) -> tuple[Choice, dict[str, Kernel]] | None:
        """The shared table's choice for ``key`` with its kernels built, or None: not there, or one of
        its kernels cannot run here (then the weight is measured)."""
        picks = None if self.shared is None else self.shared.get(repr(key))
        if picks is None:
            return None
        by_name, kernels = {c.name: c for c in pool}, {}
        for name in dict.fromkeys(p.kernel for p in picks):
            cand = by_name.get(name)
            if cand is None or (kernel := check(cand, w, self.dtype, self.device)) is None:
                log.info("shared kernel table's %s for %s cannot run here: measuring", name, tuple(w.shape))
                return None
            kernels[name] = kernel
        choice = Choice(*w.shape, weight_label(w, self.dtype), list(picks), {}, list(kernels), invariant(picks, pool))
        return choice, kernels

    def _rank0s(self, choice: Choice, built: dict[str, Kernel], w: Weight, pool: list[Candidate]) -> Choice:
        """``choice`` with rank 0's picks (:attr:`agree`); a kernel rank 0 picked that this rank did
        not build is built here, and one that cannot run here raises ``RuntimeError``."""
        names = sorted(c.name for c in pool)
        theirs = self.agree([names.index(p.kernel) for p in choice.picks])
        picks = []
        for pick, index in zip(choice.picks, theirs, strict=True):
            name = names[index]
            if name not in built:
                cand = next(c for c in pool if c.name == name)
                if (kernel := check(cand, w, self.dtype, self.device)) is None:
                    raise RuntimeError(f"rank 0 chose kernel {name} for {tuple(w.shape)}, which cannot run here")
                built[name] = kernel
            picks.append(Pick(pick.rows, name, choice.times.get(name, {}).get(pick.rows, float("nan"))))
        choice.picks, choice.invariant = picks, invariant(picks, pool)
        return choice

    @staticmethod
    def dispatch(picks: list[Pick], kernels: dict[str, Kernel]) -> Dispatch:
        """The callable that runs each bucket's pick (:class:`Single` when there is one)."""
        if len({p.kernel for p in picks}) == 1:
            kernel = kernels[picks[0].kernel]
            return Single([kernel.fn], [kernel.native or (None, kernel.fn)])
        table: list[Kernel] = []  # table[T]: the kernel of the smallest bucket >= T
        for pick in picks:
            table += [kernels[pick.kernel]] * (pick.rows + 1 - len(table))
        return Dispatch([k.fn for k in table], [k.native or (None, k.fn) for k in table])

    def _named(self, name: str, w: Weight):
        kernel = self.pool[name].build(w, self.dtype)
        kernel.name = name
        return kernel

    def table(self) -> list[tuple[Choice, int]]:
        """Every choice made, with how many weights use it, in the order they were first seen."""
        return [(choice, self.counts[key]) for key, choice in self.choices.items()]

    def report(self) -> list[KernelChoice]:
        """:meth:`table` as wire structs (the worker's ``Ready``, ``GET /workers``)."""
        return [
            KernelChoice(
                n=c.n,
                k=c.k,
                weight=c.weight,
                count=count,
                picks=[
                    KernelPick(rows=p.rows, kernel=p.kernel, ms=None if p.seconds != p.seconds else p.seconds * 1e3)
                    for p in c.picks
                ],
            )
            for c, count in self.table()
        ]

    def log_table(self) -> None:
        """One INFO line per weight shape: its format, how many weights, each bucket's kernel and time."""
        table = list(self.table())
        for choice, count in table:
            picks = ", ".join(
                f"≤{p.rows}: {p.kernel}" + ("" if p.seconds != p.seconds else f" {p.seconds * 1e3:.3g} ms")
                for p in choice.picks
            )
            log.info("kernels for %dx%d %s (%d weights): %s", choice.n, choice.k, choice.weight, count, picks)
        log.info("weights hold %.1f MiB; kernel choice measured in %.1fs", self.weight_bytes / 2**20, self.seconds)
        if self.device.type == "cuda" and (slow := row_by_row(table)):
            log.warning(
                "%d of %d weights run a row-by-row kernel: no faster kernel here gives a row the same bits at every "
                "row count, so a step's time grows with its rows; workers.deterministic: false runs the fastest "
                "kernels (a sequence's tokens may then depend on its batch)",
                *slow,
            )
