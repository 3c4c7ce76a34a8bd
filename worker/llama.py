"""A compact Llama-family forward pass over flattened tokens and a block KV cache.

Llama 2/3, Mistral (without a sliding window) and SmolLM2 share this architecture: RMSNorm, rotary
position embeddings, grouped-query attention, a SwiGLU MLP. The forward pass follows nano-vllm's
and gpt-fast's shape rather than transformers': every scheduled token of every sequence, decode and
prefill chunk alike, is one row of a ``[T, hidden]`` matrix, so each projection is one matmul per
step; q/k/v and gate/up are fused into one weight each; keys and values go straight into the block
cache (:mod:`worker.attention`). A step costs ~15 tensor operations per layer where transformers'
modules cost ~40 — on a CPU, where a small model's decode step is bound by per-operation dispatch
more than by reading the weights, that is most of the step (docs/design/engine.md).

Weights are read from the model folder's safetensors files by their transformers names
(``model.layers.N.self_attn.q_proj.weight`` ...), straight onto the target device.

Tensor parallel (``tp``, a :class:`worker.tp.TPGroup` of N ranks): each rank loads only its part
of each weight (:func:`worker.contract.tp_rules.shard_range`) — H/N query heads and KVH/N KV heads of the
fused qkv, I/N channels of gate/up, the matching input columns of o_proj and down_proj — and
attends over its own KV heads; the partial outputs of o_proj and down_proj are summed over the
ranks in float32 (one all-reduce each per layer) before joining the float32 residual stream.
Embeddings, norms and the LM head are replicated. With one rank none of this runs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from worker.attention import AttentionBatch, KVCache, attend_kv, paged_ops
from worker.contract.llama_family import ARCHITECTURES, supports  # noqa: F401 (the family's home; used as llama.supports)
from worker.contract.shapes import attention_dims
from worker.contract.tp_rules import shard_range
from worker.quant.gguf import fused_linear
from worker.quant.linear import Single
from worker.rope import rope_tables

log = logging.getLogger(__name__)


class Layer:
    """One decoder layer's weights: fused ``qkv`` [(H + 2·KVH)·D, hidden], ``o`` [hidden, H·D],
    fused ``gate_up`` [2·I, hidden], ``down`` [hidden, I], the two RMSNorm weights, optional q/k/v
    bias and o_proj bias [hidden] (``attention_bias``: float32, added once after the ranks' sum)."""

    __slots__ = ("attn_norm", "down", "gate_up", "mlp_norm", "o", "o_bias", "qkv", "qkv_bias")


class LlamaModel:
    """The whole model as plain tensors; ``forward`` runs one engine step.

    ``linear`` turns a weight [out, in] into a callable ``x [T, in] -> [T, out]``: plain
    ``F.linear`` by default; the engine passes :class:`worker.quant.linear.Linears` (quantized at
    load when asked, the kernel measured fastest per row count). ``head_linear`` does the same for
    the LM head (default: ``linear``), and ``embedding`` turns the embedding table [V, hidden] into a
    callable ``ids [T] -> [T, hidden]`` float32 (default: ``F.embedding`` on it). ``tp``: this rank's tensor-parallel group, with
    ``weights`` already this rank's shards (:func:`load_weights`); ``heads`` and ``kv_heads`` are
    then this rank's counts.
    """

    def __init__(
        self,
        config,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int,
        linear=None,
        tp=None,
        head_linear=None,
        embedding=None,
    ):
        self.config = config
        self.device, self.dtype = device, dtype
        self.num_layers = config.num_hidden_layers
        self.heads, self.kv_heads, self.head_dim = attention_dims(config)
        self.reduce = None  # sums a row-parallel layer's partial outputs over the ranks
        self.scratch: torch.Tensor | None = None  # SiLU·up in down_proj's dtype, reused by every layer (_mlp)
        self.invariant = False  # batch-invariant attention (workers.deterministic): worker.attention
        if tp is not None and tp.world > 1:
            self.heads, self.kv_heads = self.heads // tp.world, self.kv_heads // tp.world
            self.reduce = tp.all_reduce
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim**-0.5
        make = linear or _plain_linear
        p = "model."
        table = weights[p + "embed_tokens.weight"]  # [V, hidden], float or quantized
        self.norm = weights[p + "norm.weight"].float()
        head = weights.get("lm_head.weight", table)  # tied: SmolLM2
        self.lm_head = (head_linear or make)(head)
        self.embed = (embedding or _plain_embedding)(table)
        self.layers: list[Layer] = []
        for i in range(self.num_layers):
            q = f"{p}layers.{i}."
            a = q + "self_attn."
            layer = Layer()
            layer.attn_norm = weights[q + "input_layernorm.weight"].float()
            layer.mlp_norm = weights[q + "post_attention_layernorm.weight"].float()
            layer.qkv = fused_linear(make, [weights[a + n + "_proj.weight"] for n in "qkv"])
            bias = [weights.get(a + n + "_proj.bias") for n in "qkv"]
            layer.qkv_bias = torch.cat(bias) if all(b is not None for b in bias) else None
            layer.o = _with_native(make(weights[a + "o_proj.weight"]))
            o_bias = weights.get(a + "o_proj.bias")  # replicated: every rank holds it whole
            layer.o_bias = o_bias.float() if o_bias is not None else None
            m = q + "mlp."
            layer.gate_up = _with_native(
                fused_linear(make, [weights[m + "gate_proj.weight"], weights[m + "up_proj.weight"]])
            )
            layer.down = _with_native(make(weights[m + "down_proj.weight"]))
            self.layers.append(layer)
        self.cos, sin = rope_tables(config, max_positions, device)  # [P, D] float32
        # rotate_half(x) * sin == roll(x, D/2) * sin with its first half negated, bit for bit (the
        # sign moves from x to sin), in one roll instead of two slices, a negation and a cat per layer
        half = self.head_dim // 2
        self.sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        cache: KVCache,
        logit_rows: torch.Tensor | None,
        hidden_rows: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """One step. ``input_ids``, ``positions``: [T] (long); ``batch`` says which rows belong to which
        sequence and where their keys/values go; ``logit_rows``: [N] row indices whose next-token
        logits are wanted. Returns logits [N, V] in float32; ``None`` for ``logit_rows=None`` (a
        tensor-parallel rank other than 0, which fills its KV share and takes part in the sums).
        With ``hidden_rows`` [M] it returns ``(logits, hidden)``: those rows' final hidden states
        [M, hidden], which :meth:`head` turns into logits (prompt logprobs, a slice at a time)."""
        H, KVH, D = self.heads, self.kv_heads, self.head_dim
        dt, reduce = self.dtype, self.reduce
        x = self.embed(input_ids)  # [T, hidden] float32, a fresh tensor: the residual adds go in place
        cast = (lambda t: t) if dt == torch.float32 else (lambda t: t.to(dt))  # no op per call in float32
        cos = cast(self.cos[positions])[:, None, :]  # [T, 1, D], gathered once per step for every layer
        sin = cast(self.sin_signed[positions])[:, None, :]
        half = D // 2
        norm = self._norm(x.device)
        rows = x.shape[0]
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(cast(norm(x, layer.attn_norm, self.eps)))  # [T, (H + 2 KVH) D]
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            qk = qkv[:, : (H + KVH) * D].view(-1, H + KVH, D)  # rotate q and k at once, in place:
            torch.add(qk * cos, qk.roll(half, -1) * sin, out=qk)  # then k and v are the cache's rows
            kv = qkv[:, H * D :].view(-1, 2, KVH, D)  # [T, 2, KVH, D]
            att = attend_kv(qk[:, :H], kv, cache, i, batch, self.scale, self.invariant)
            o = self._into_residual(layer.o, att, rows)
            x += o if reduce is None else reduce(o)  # float32 += o's own dtype: the same sum as after a cast
            if layer.o_bias is not None:
                x += layer.o_bias
            m = self._mlp(layer, cast(norm(x, layer.mlp_norm, self.eps)), rows)
            x += m if reduce is None else reduce(m)
        if logit_rows is None:
            return None
        if hidden_rows is not None:
            return self.head(x[logit_rows]), x[hidden_rows]
        return self.head(x[logit_rows])

    def _norm(self, device: torch.device) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
        """The layers' RMSNorm: torch's operations (:func:`rms_norm_cpu` on a CPU); batch-invariant
        (``invariant``) on a CPU where the compiled operators are built, their ``rms_norm``, the one
        the captured decode step runs, so a row's values are the same decoded or prefilled."""
        ops = paged_ops(device) if self.invariant else None
        if ops is not None:
            return lambda x, weight, eps: ops.rms_norm(x, weight, eps, torch.float32)
        return rms_norm_cpu if device.type == "cpu" else _rms_norm

    def _into_residual(self, linear, x: torch.Tensor, rows: int) -> torch.Tensor:
        """``linear(x)`` for a float32 residual add: in the kernel's own dtype where it casts to one
        (no cast back: widening to float32 inside the add is exact), else in the compute dtype."""
        act, fn = linear.native(rows)
        if act is None or act == x.dtype or self.dtype != torch.float32:
            return linear(x)  # a narrower output would round where the cast to the compute dtype rounds
        return fn(x.to(act))

    def _mlp(self, layer: Layer, x: torch.Tensor, rows: int) -> torch.Tensor:
        """down(SiLU(gate)·up) of the normed rows ``x`` [T, hidden], for the residual add. Where gate/up
        and down cast to the same dtype of their own in a float32 model (bfloat16 int8 kernels), gate/up's
        output stays in it: only gate is widened for SiLU, and the product, computed in float32 as
        before, is written in down's dtype straight into a buffer the layers share: the same values in
        four tensor operations instead of five (two of them casts of the whole [T, 2·I])."""
        ops = paged_ops(x.device) if self.invariant else None
        if ops is not None:  # batch-invariant: the captured step's SiLU·up (its exp), as it calls it
            (act, fn), (down_act, down) = (self._uncast(f, rows) for f in (layer.gate_up, layer.down))
            return down(ops.silu_mul(fn(x.to(act)), self.dtype, down_act))
        act, fn = layer.gate_up.native(rows)
        down_act, down = layer.down.native(rows)
        if act is None or down_act != act or self.dtype != torch.float32:
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            return self._into_residual(layer.down, F.silu(gate).mul_(up), rows)
        gate, up = fn(x.to(act)).chunk(2, dim=-1)  # [T, I] each
        buf = self.scratch
        if buf is None or buf.shape != up.shape or buf.dtype != act:
            buf = self.scratch = torch.empty(up.shape, dtype=act, device=up.device)  # once per step size
        return down(torch.mul(F.silu(gate.float()), up, out=buf))

    def _uncast(self, linear, rows: int) -> tuple[torch.dtype, Callable]:
        """``(input dtype, fn)`` of ``linear`` at ``rows`` rows as the captured step calls it
        (:func:`worker.step.decode._native`): its kernel without casts in a float32 model, else itself."""
        act, fn = linear.native(rows) if self.dtype == torch.float32 else (None, None)
        return (self.dtype, linear) if act is None else (act, fn)

    @torch.inference_mode()
    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: residual rows [N, hidden] (float32) -> logits [N, V] (float32). In a
        bfloat16 / float16 model whose head kernel sums in float32 and rounds its output to the compute
        dtype (:meth:`~worker.quant.linear.Dispatch.native` in float32), the logits are taken before
        that rounding: the same products, but no grid of 0.125 near a logit of 25 to tie two tokens."""
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps).to(self.dtype)
        if self.dtype != torch.float32 and hasattr(self.lm_head, "native"):
            act, fn = self.lm_head.native(x.shape[0])
            if act == torch.float32:
                return fn(x.float())
        return self.lm_head(x).float()


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, (hidden,), weight, eps)`` for float32 ``x`` [T, hidden] on a CPU, written out:
    torch's CPU composite's operations in its order (bit for bit its values), six calls from Python
    instead of one that dispatches fourteen; faster inside a decode step (docs/design/engine.md)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps)) * weight


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused kernel on a GPU


def _plain_linear(weight: torch.Tensor):
    return lambda x: F.linear(x, weight)


def _with_native(fn):
    """``fn`` with :meth:`~worker.quant.linear.Dispatch.native`: itself when it has it (a tuned
    layer's), else a :class:`~worker.quant.linear.Single` computing in the caller's dtype (plain
    ``F.linear``, a GGUF layer's parts joined)."""
    return fn if hasattr(fn, "native") else Single([fn], [(None, fn)])


def _plain_embedding(table: torch.Tensor):
    return lambda ids: F.embedding(ids, table).float()


def load_weights(
    model_path: str, device: torch.device, dtype: torch.dtype, rank: int = 0, world: int = 1
) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's safetensors files (sharded or not), cast to ``dtype`` on ``device``.
    Loads straight to ``device``: no host copy of a GPU model. With ``world`` > 1 only rank
    ``rank``'s part of each split weight is read (:func:`worker.contract.tp_rules.shard_range`)."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(folder / name, framework="pt", device=str(device)) as f:
            for key in f.keys():
                part = f.get_slice(key)
                where = shard_range(key, tuple(part.get_shape()), rank, world)
                if where is None:
                    weights[key] = f.get_tensor(key).to(dtype)
                else:
                    dim, start, stop = where
                    weights[key] = (part[start:stop] if dim == 0 else part[:, start:stop]).to(dtype)
    return weights


def random_weights(
    config, device: torch.device, dtype: torch.dtype, seed: int = 0, rank: int = 0, world: int = 1
) -> dict[str, torch.Tensor]:
    """Random weights with transformers' names and Llama's shapes, for benchmarks without a checkpoint
    (``model.random_init``): normal(0, 0.02) matrices, unit norms. With ``world`` > 1, rank
    ``rank``'s shards of the same weights (each drawn whole, then cut). Drawn on ``device`` when it is
    a GPU (no draw on the CPU and copy over of every weight), else on the CPU: the same seed gives
    the same weights on every GPU of one kind, not the CPU's."""
    drawn_on = device if device.type == "cuda" else torch.device("cpu")
    g = torch.Generator(device=drawn_on).manual_seed(seed)
    heads, kv_heads, d = attention_dims(config)
    hid, inter = config.hidden_size, config.intermediate_size

    def mat(name: str, *shape: int) -> tuple[str, torch.Tensor]:
        t = torch.randn(*shape, generator=g, device=drawn_on) * 0.02  # drawn whole on every rank: the same weights
        if (where := shard_range(name, shape, rank, world)) is not None:
            t = t.narrow(where[0], where[1], where[2] - where[1]).contiguous()
        return name, t.to(device=device, dtype=dtype)

    def ones(name: str) -> tuple[str, torch.Tensor]:
        return name, torch.ones(hid, device=device, dtype=dtype)

    w = dict([mat("model.embed_tokens.weight", config.vocab_size, hid), ones("model.norm.weight")])
    if not getattr(config, "tie_word_embeddings", False):
        w.update([mat("lm_head.weight", config.vocab_size, hid)])
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        w.update(
            [
                ones(p + "input_layernorm.weight"),
                ones(p + "post_attention_layernorm.weight"),
                mat(a + "q_proj.weight", heads * d, hid),
                mat(a + "k_proj.weight", kv_heads * d, hid),
                mat(a + "v_proj.weight", kv_heads * d, hid),
                mat(a + "o_proj.weight", hid, heads * d),
                mat(m + "gate_proj.weight", inter, hid),
                mat(m + "up_proj.weight", inter, hid),
                mat(m + "down_proj.weight", hid, inter),
            ]
        )
    return w
