"""A padded batch of sequences sharing one preallocated KV cache: the data structure of continuous batching.

This is TGI's early design for plain transformers models (``CausalLMBatch.concatenate`` and
``.filter`` in text-generation-inference's ``causal_lm.py``): the running sequences form one
left-padded batch, so every decode step is a single ``[B, 1]`` forward pass over the model's own
attention. What differs from TGI (and from ``DynamicCache``) is where the keys and values live:

* one buffer per device, ``[layers, 2, rows, kv_heads, columns, head_dim]``, allocated once and
  reused, instead of a ``torch.cat`` per layer per step (which copied the whole cache every step:
  43% of a batch-8 decode step on CPU before this change);
* rows ``[0, B)`` are the running sequences; a row's tokens are right-aligned at the shared write
  cursor ``end``, so row ``r`` holds its ``lens[r]`` tokens in columns ``[end - lens[r], end)`` and
  the step attends over the window ``[start, end)`` with ``start = end - max(lens)``;
* newcomers are prefilled straight into free rows ``[B, B + n)`` (their own forward pass, which
  attends only to their prompt), so joining costs no copy; a retiring row is filled by moving the
  rows after it up (one row copy each), and the window shrinks for free;
* the window is re-laid (one copy of it) only when the cursor reaches the last column or a
  newcomer's prompt is longer than the room left of the cursor, by shifting it inside the buffer;
  a new, larger buffer is allocated only when more rows or columns are needed than allocated.
  Right of the cursor it keeps room for the longest remaining worst case, at most ``max_slack``
  columns, so the cursor wraps at most once per ``max_slack`` steps.

Padding is never attended (the decode mask comes from ``lens``) and never shifts RoPE positions
(position = number of real tokens so far), so a sequence decodes the same alone or batched.
Stale keys from earlier rows stay in masked columns; the buffer starts zeroed, so they are finite.

On CPU the buffer is an anonymous ``mmap`` (zeroed by the kernel, unmapped when freed), so KV
memory never fragments the malloc heap: after the batch empties, the worker's RSS is back where it
was (the memory-stability check of issue 6). On GPU it is an ordinary tensor.
"""

from __future__ import annotations

import mmap

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from worker.model import kv_shape


class _Cursor:
    """Which rows and columns the current forward pass reads and writes (shared by every layer)."""

    __slots__ = ("row0", "row1", "start", "write")

    def __init__(self) -> None:
        self.row0 = self.row1 = self.start = self.write = 0


class _WindowLayer(CacheLayerMixin):
    """One layer's keys and values: views into the batch buffer. ``update`` writes the step's new
    keys/values at the cursor and returns the attended window as views (no copy)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cursor: _Cursor):
        super().__init__()
        self.cursor = cursor  # no reference back to the batch: no cycle holds the buffer alive
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        c = self.cursor
        end = c.write + key_states.shape[2]  # key_states: [rows, kv_heads, q, head_dim]
        self.keys[c.row0:c.row1, :, c.write:end] = key_states
        self.values[c.row0:c.row1, :, c.write:end] = value_states
        return self.keys[c.row0:c.row1, :, c.start:end], self.values[c.row0:c.row1, :, c.start:end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cursor.write - self.cursor.start + query_length, 0

    def get_seq_length(self) -> int:
        return self.cursor.write - self.cursor.start

    def get_max_length(self) -> int:
        return -1


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on CPU backed by its own anonymous mmap, returned to the OS when freed."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = 1
    for n in shape:
        count *= n
    buf = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


def _layer_devices(model, num_layers: int, default: torch.device) -> list[torch.device]:
    """The device of each decoder layer (they differ when a model is split across GPUs)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) != num_layers:
        return [default] * num_layers
    return [next(layer.parameters()).device for layer in layers]


class PaddedBatch:
    """KV cache and per-row lengths of up to ``max_rows`` running sequences.

    ``add`` prefills newcomers into new rows; ``decode`` runs one step for every row; ``filter``
    keeps some rows. An empty batch holds no buffer (an idle worker holds no KV memory).
    """

    def __init__(self, model, device: torch.device, max_rows: int, max_slack: int = 128):
        self.num_layers, self.kv_heads, self.head_dim = kv_shape(model.config)
        self.dtype = next(model.parameters()).dtype
        self.device = device
        self.max_rows = max_rows
        self.max_slack = max_slack
        self.cursor = _Cursor()
        self.cache = Cache(layers=[_WindowLayer(self.cursor) for _ in range(self.num_layers)])
        devices = _layer_devices(model, self.num_layers, device)
        self._groups: dict[torch.device, list[int]] = {}
        for i, d in enumerate(devices):
            self._groups.setdefault(d, []).append(i)
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.lens: list[int] = []    # real tokens per row (in the cache)
        self.limits: list[int] = []  # worst-case total tokens per row (prompt + max new tokens)
        self.start = self.end = 0    # the window of columns rows are attending over
        self.rows_allocated = self.columns = 0
        self.relayouts = 0           # times the window was re-laid (for tests and stats) ...
        self.grows = 0               # ... of which into a new, larger buffer

    @property
    def size(self) -> int:
        return len(self.lens)

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def allocated_tokens(self) -> int:
        """Token slots of the buffer (rows × columns), padding and slack included."""
        return self.rows_allocated * self.columns

    # ---- the three operations -----------------------------------------------------------

    @torch.inference_mode()
    def add(self, model, prompts: list[list[int]], limits: list[int], pad_id: int) -> torch.Tensor:
        """Prefill ``prompts`` (as one left-padded batch) into new rows after the current ones.

        ``limits``: each newcomer's worst-case total length. Returns last-position logits [n, V].
        """
        n, longest = len(prompts), max(len(p) for p in prompts)
        rows = self.size + n
        need_right = max([lim - len(p) for p, lim in zip(prompts, limits)] + self._remaining(), default=1)
        if rows > self.rows_allocated or self.end < longest:
            self._relayout(rows, need_left=longest, need_right=need_right)
        input_ids = torch.full((n, longest), pad_id, dtype=torch.long)
        mask = torch.zeros((n, longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # input_ids, mask: [n, longest]
            input_ids[row, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, longest - len(prompt):] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        first = self.end - longest
        c = self.cursor
        c.row0, c.row1, c.start, c.write = self.size, rows, first, first
        out = model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                    position_ids=positions.to(self.device), cache=self.cache, use_cache=True, logits_to_keep=1)
        self.start = first if not self.lens else min(self.start, first)
        self.lens += [len(p) for p in prompts]
        self.limits += list(limits)
        return out.logits[:, -1, :]  # [n, V]

    @torch.inference_mode()
    def decode(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """One decode step. ``input_ids``: [B] last sampled tokens. Returns logits [B, V]."""
        if self.end >= self.columns:
            self._relayout(self.size, need_left=0, need_right=max(self._remaining(), default=1))
        lens = torch.tensor(self.lens, dtype=torch.long, device=self.device)  # [B]
        cols = torch.arange(self.start, self.end + 1, device=self.device)      # [W + 1]
        mask = cols[None, :] >= (self.end - lens)[:, None]                     # [B, W + 1], True = attend
        c = self.cursor
        c.row0, c.row1, c.start, c.write = 0, self.size, self.start, self.end
        out = model(input_ids=input_ids[:, None], attention_mask=mask[:, None, None, :],
                    position_ids=lens[:, None], cache=self.cache, use_cache=True, logits_to_keep=1)
        self.end += 1
        self.lens = [n + 1 for n in self.lens]
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def filter(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (old indices, ascending) in that order; an empty ``keep`` frees the buffer."""
        if not keep:
            self._release()
            return
        for new, old in enumerate(keep):  # ascending: a source row is never overwritten before it is read
            if new != old:
                for buf in self.buffers.values():  # buf: [layers, 2, rows, kv_heads, columns, head_dim]
                    buf[:, :, new, :, self.start:self.end].copy_(buf[:, :, old, :, self.start:self.end])
        self.lens = [self.lens[i] for i in keep]
        self.limits = [self.limits[i] for i in keep]
        self.start = self.end - max(self.lens)

    # ---- buffer management --------------------------------------------------------------

    def _remaining(self) -> list[int]:
        return [lim - n for n, lim in zip(self.lens, self.limits)]

    def _relayout(self, rows: int, need_left: int, need_right: int) -> None:
        """Make room for ``rows`` rows, ``need_left`` columns left of the cursor and ``need_right``
        (capped at ``max_slack``) right of it: shift the window inside the buffer when it fits, else
        move it into a new, larger buffer (so memory is never doubled just to move the cursor)."""
        width = self.end - self.start
        end = max(width, need_left)
        columns = end + max(1, min(need_right, self.max_slack))
        if self.buffers and rows <= self.rows_allocated and columns <= self.columns:
            self._shift(end - width)
        else:
            self._grow(max(rows, min(self.max_rows, 2 * self.rows_allocated), 1), columns, end)
        self.start, self.end = end - width, end
        self.relayouts += 1

    def _shift(self, new_start: int) -> None:
        """Move the window to start at ``new_start`` in place, in chunks no longer than the shift, so
        no chunk's source is overwritten before it is read."""
        width, step = self.end - self.start, abs(new_start - self.start)
        if not step or not width or not self.size:
            return
        offsets = list(range(0, width, step))
        if new_start > self.start:
            offsets.reverse()
        for buf in self.buffers.values():  # buf: [layers, 2, rows, kv_heads, columns, head_dim]
            for off in offsets:
                n = min(step, width - off)
                buf[:, :, :self.size, :, new_start + off:new_start + off + n].copy_(
                    buf[:, :, :self.size, :, self.start + off:self.start + off + n])

    def _grow(self, rows_allocated: int, columns: int, end: int) -> None:
        width = self.end - self.start
        old, self.buffers = self.buffers, {}
        for device, layers in self._groups.items():
            shape = (len(layers), 2, rows_allocated, self.kv_heads, columns, self.head_dim)
            buf = _zeros(shape, self.dtype, device)
            if old and width and self.size:
                buf[:, :, :self.size, :, end - width:end] = old[device][:, :, :self.size, :, self.start:self.end]
            self.buffers[device] = buf
            for j, layer in enumerate(layers):
                self.cache.layers[layer].keys, self.cache.layers[layer].values = buf[j, 0], buf[j, 1]
        del old
        self.rows_allocated, self.columns = rows_allocated, columns
        self.grows += 1

    def _release(self) -> None:
        self.buffers = {}
        for layer in self.cache.layers:
            layer.keys = layer.values = None
        self.lens, self.limits = [], []
        self.start = self.end = self.rows_allocated = self.columns = 0
