"""The Python half of ``scripts/gpu_check.sh``: request drivers, a memory hog, a random-weight
model folder, the copy-bandwidth probe and the engine bench. Standard library + torch only.

    python scripts/gpu_check.py dry-run                       # every piece on CPU, no GPU needed
    python scripts/gpu_check.py concurrent URL MODEL          # 8 mixed prompts at once, T=0.8, seeded
    python scripts/gpu_check.py pick-util DEPLOY.yaml         # gpu_memory_utilization for ~1.5 sequences of KV
    python scripts/gpu_check.py near-budget URL ADMIN MODEL   # requests that together overrun the KV budget
    python scripts/gpu_check.py hog                           # hold (almost) all free memory of cuda:0 until killed
    python scripts/gpu_check.py oom URL ADMIN MODEL LOG       # a batch while the hog holds the memory
    python scripts/gpu_check.py make-model DIR [--shape S]    # Llama-3-8B (or SmolLM2-135M) config + tokenizer, no weights
    python scripts/gpu_check.py bandwidth                     # device-to-device copy GB/s
    python scripts/gpu_check.py bench URL MODEL DIR           # concurrency 1/8/32/64 against the bandwidth floor
        [--admin URL --label L --record FILE]                 #   the floor from the weights the worker holds; keep the rows
    python scripts/gpu_check.py bench-summary FILE            # the recorded variants in one table, greedy agreement

Every command prints what it measured and exits 1 when its condition does not hold.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for launcher.*
GiB = 2**30  # worker.contract.units.GiB; this script imports the repository only inside its commands


# Llama-3-8B's published config (meta-llama/Meta-Llama-3-8B config.json), weights not needed.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}

# SmolLM2-135M-Instruct's shape (the embedded default's GGUF metadata), for a host without the model wheel.
SMOLLM2_135M = {
    **LLAMA3_8B,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
SHAPES = {"llama3-8b": LLAMA3_8B, "smollm2-135m": SMOLLM2_135M}


# ---- HTTP: one streamed completion ---------------------------------------------------------


@dataclass
class Result:
    """One streamed request: status, text, token count, and when each chunk arrived (seconds)."""

    status: int = 0
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    error: str = ""
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def step(self) -> float | None:
        """Mean gap between chunks after the first: one decode step when one token comes per step."""
        return (self.chunks[-1] - self.chunks[0]) / (len(self.chunks) - 1) if len(self.chunks) > 1 else None


def stream(url: str, path: str, body: dict, timeout: float = 300.0) -> Result:
    """POST ``body`` with ``stream: true`` and read the SSE chunks (OpenAI's format)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    res = Result(sent=time.perf_counter())
    try:
        conn.request(
            "POST",
            parts.path.rstrip("/") + path,
            json.dumps({**body, "stream": True}),
            {"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = resp.read().decode(errors="replace")[:300]
            return res
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                res.error = json.dumps(event["error"])[:300]
                continue
            for choice in event.get("choices", []):
                delta = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if delta:
                    res.text += delta
                    res.chunks.append(time.perf_counter())
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
            if event.get("usage"):
                res.tokens = event["usage"].get("completion_tokens", res.tokens)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return res


def all_at_once(calls: list) -> list[Result]:
    """Run the zero-argument ``calls`` in parallel threads; results in the same order."""
    out: list[Result | None] = [None] * len(calls)

    def run(i: int) -> None:
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


def get_json(url: str) -> dict:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", parts.path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def workers(admin: str) -> list[dict]:
    return get_json(admin.rstrip("/") + "/admin/workers")["workers"]


def incarnations(admin: str) -> dict[int, tuple[int, int]]:
    """worker id → (pid, restarts): equal before and after means no worker was lost."""
    return {w["id"]: (w["pid"], w["restarts"]) for w in workers(admin)}


# ---- concurrent, seeded, temperature 0.8 ---------------------------------------------------

WORDS = "the of and to in is that for it as with was on be by this are from or an which at not".split()


def mixed_prompts(n: int = 8, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` chat prompts from a few words to ~1,500 tokens, with mixed ``max_tokens``."""
    rng = random.Random(seed)
    lengths = [4, 16, 64, 200, 400, 800, 1200, 1500]
    out = []
    for i in range(n):
        filler = " ".join(rng.choice(WORDS) for _ in range(lengths[i % len(lengths)]))
        out.append((f"Summarise this in one sentence: {filler}", [16, 48, 96, 128][i % 4]))
    return out


def concurrent(url: str, model: str, admin: str | None, n: int = 8) -> bool:
    """``n`` mixed prompts at once at temperature 0.8 with seeds: every one 200 with text and a
    finish reason, no worker lost; then prompt 0 again alone and how much of it agrees with its
    batched run (bf16 GEMMs vary with batch size on GPU, so equality is not expected there)."""
    before = incarnations(admin) if admin else {}

    def body(i: int, prompt: str, max_tokens: int) -> dict:
        return {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.8,
            "seed": 1000 + i,
            "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
        }

    prompts = mixed_prompts(n)
    results = all_at_once(
        [lambda i=i, p=p, m=m: stream(url, "/chat/completions", body(i, p, m)) for i, (p, m) in enumerate(prompts)]
    )
    ok = True
    for i, r in enumerate(results):
        good = r.status == 200 and not r.error and r.finish_reason in ("stop", "length") and r.text
        ok &= bool(good)
        print(
            f"  prompt {i} ({len(prompts[i][0].split())} words, max_tokens {prompts[i][1]}): HTTP {r.status}, "
            f"{r.tokens} tokens, finish {r.finish_reason}{'' if good else ' FAILED ' + r.error}"
        )
    alone = stream(url, "/chat/completions", body(0, *prompts[0]))
    print(
        f"  prompt 0 alone vs batched (seed 1000): {match_rate(alone.text, results[0].text):.2f} of the text agrees "
        "(bf16 on GPU may differ with batch size)"
    )
    if admin and incarnations(admin) != before:
        print(f"  a worker was lost or restarted: before {before}, after {incarnations(admin)}")
        ok = False
    return ok


def match_rate(a: str, b: str) -> float:
    """The common prefix of ``a`` and ``b`` as a share of the longer one (1.0 = identical)."""
    if not a and not b:
        return 1.0
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return same / max(len(a), len(b))


# ---- KV budget: pick a utilization, then overrun it ----------------------------------------


def pick_util(deploy: str, seqs: float = 1.5) -> float:
    """The smallest ``gpu_memory_utilization`` (to 1e-3) whose planned KV budget
    holds ``seqs`` ``max_model_len`` sequences on this machine's first GPU (or a hypothetical
    141 GB one without a GPU), by ``launcher.plan.plan`` — the rule the worker applies."""
    from launcher.config import load_config
    from launcher.plan.context import AUTO, native_context
    from launcher.plan.placement import discover
    from launcher.plan.plan import parse_gpus
    from launcher.plan.shape import read_shape
    from launcher.plan.sizing import planned_budget, size
    from worker.contract.shapes import weight_format

    cfg = load_config(deploy)
    inv = discover()
    gpu = (inv.gpus or parse_gpus("141GB"))[0]
    shape = read_shape(cfg.model.name)
    length = native_context(shape) if cfg.model.max_model_len == AUTO else cfg.model.max_model_len
    sizing = size(
        shape,
        "bfloat16",
        length,
        cfg.workers.max_num_seqs,
        max(cfg.workers.prefill_budgets(on_gpu=True)),
        weight_format(cfg.model.quantization, shape.gguf_types),
    )
    want = int(seqs * length)
    lo, hi = 0.001, 1.0
    if planned_budget([gpu], sizing, hi).tokens < want:
        raise SystemExit(f"even gpu_memory_utilization 1.0 holds fewer than {want} tokens on {gpu.name}")
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if planned_budget([gpu], sizing, mid).tokens < want else (lo, mid)
    return math.ceil(hi * 1000) / 1000


def near_budget(url: str, admin: str, model: str, max_model_len: int) -> bool:
    """Requests of ~0.6 × max_model_len tokens each at once, two more than the worker's KV budget
    (planned at ~1.5 sequences; the worker measures its own) holds together: admission must hold
    some back, and all end 200 with no worker lost."""
    w = workers(admin)[0]
    budget = w["kv_budget_tokens"]
    print(f"  worker KV budget {budget} tokens = {budget / max_model_len:.2f} × max_model_len {max_model_len}")
    if budget < max_model_len:
        print("  the worker became Ready below one max_model_len sequence of KV")
        return False
    before = incarnations(admin)
    prompt_len, new = int(0.5 * max_model_len), int(0.1 * max_model_len)
    n = budget // (prompt_len + new) + 2
    print(f"  {n} requests of {prompt_len} + {new} tokens: {n * (prompt_len + new) / budget:.2f} × the budget")
    rng = random.Random(1)

    def call(i: int) -> Result:
        ids = [rng.randrange(100, 20000) for _ in range(prompt_len)]
        return stream(
            url,
            "/completions",
            {
                "model": model,
                "prompt": ids,
                "max_tokens": new,
                "temperature": 0,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        )

    results = all_at_once([lambda i=i: call(i) for i in range(n)])
    ok = incarnations(admin) == before
    for i, r in enumerate(results):
        ok &= r.status == 200 and not r.error and r.tokens == new
        print(f"  request {i}: {prompt_len} + {new} tokens: HTTP {r.status}, {r.tokens} tokens {r.error}")
    return ok


# ---- a deliberate OOM ----------------------------------------------------------------------


def grab_plan(free_bytes: int, keep_bytes: int = 8 * 2**20) -> list[int]:
    """Chunk sizes that take ``free_bytes − keep_bytes`` in 1 GiB pieces, then halving down to
    2 MiB, so fragmentation cannot leave a large hole behind."""
    left, sizes, chunk = max(0, free_bytes - keep_bytes), [], GiB
    while chunk >= 2 * 2**20:
        while left >= chunk:
            sizes.append(chunk)
            left -= chunk
        chunk //= 2
    return sizes


def hog() -> None:
    """Hold (almost) all free memory of cuda:0 until killed; prints what it holds."""
    import torch

    free, _ = torch.cuda.mem_get_info(0)
    held = []
    for n in grab_plan(free):
        try:
            held.append(torch.empty(n, dtype=torch.uint8, device="cuda:0"))
        except torch.OutOfMemoryError:
            continue
    print(
        f"holding {sum(t.numel() for t in held) / GiB:.2f} GiB of cuda:0; "
        f"{torch.cuda.mem_get_info(0)[0] / 2**20:.0f} MiB left free",
        flush=True,
    )
    threading.Event().wait()


def oom(url: str, admin: str, model: str, log: str, hog_seconds: float = 20.0) -> bool:
    """With a hog holding the memory (the caller starts it), send 4 long prompts: the worker
    must meet an OutOfMemoryError and survive it (same pid, no restart). After ``hog_seconds``
    this prints ``RELEASE`` (the caller kills the hog then); every request must end, and one
    more request after the hog must succeed."""
    before = incarnations(admin)
    rng = random.Random(2)
    bodies = [
        {
            "model": model,
            "prompt": [rng.randrange(100, 20000) for _ in range(2000)],
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        }
        for _ in range(4)
    ]
    results: list[Result] = []
    sender = threading.Thread(
        target=lambda: results.extend(all_at_once([lambda b=b: stream(url, "/completions", b, 120) for b in bodies]))
    )
    sender.start()
    sender.join(hog_seconds)
    print("RELEASE", flush=True)  # the shell kills the hog on this line
    sender.join(120)
    hit = bool(re.search(r"out of memory|OutOfMemory", Path(log).read_text(errors="replace"), re.IGNORECASE))
    for i, r in enumerate(results):
        print(f"  request {i} under the hog: HTTP {r.status} {r.error[:120]}")
    after = stream(url, "/completions", {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    print(f"  after the hog: HTTP {after.status} {after.error[:120]}; OOM seen in the log: {hit}")
    ok = incarnations(admin) == before and after.status == 200 and not sender.is_alive()
    if incarnations(admin) != before:
        print(f"  the worker did not survive: before {before}, after {incarnations(admin)}")
    if not hit:
        print("  warning: no OutOfMemoryError was logged, so this run did not exercise the OOM path")
    return ok


# ---- the engine bench on a random-weight Llama-3-8B shape -----------------------------------


def make_model(folder: Path, shape: str = "llama3-8b") -> int:
    """Write the ``config.json`` of :data:`SHAPES` ``[shape]`` (Llama-3-8B by default) and a word-level
    tokenizer covering its ids (``<s> </s> <unk> t3`` … ``t128255`` for Llama-3-8B) into ``folder``; no
    weights (``model.random_init: true`` builds them). Returns the bf16 weight bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from worker.contract.shapes import from_hf_config

    config = SHAPES[shape]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    specials = ["<s>", "</s>", "<unk>"]  # ids 0-2; not "t0".."t2", which would match inside "t128255"
    vocab = {**{t: i for i, t in enumerate(specials)}, **{f"t{i}": i for i in range(3, config["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": config["max_position_embeddings"],
                "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
            }
        )
    )
    return 2 * from_hf_config(config).params


def bandwidth(device: str = "cuda", mib: int = 2048, repeats: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a ``mib`` MiB device-to-device copy (read + write
    bytes counted), best of ``repeats``."""
    import torch

    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = math.inf
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


def summarize(level: int, results: list[Result], wall_s: float, floor_s: float) -> dict:
    """One bench row: output tok/s over the wave, TTFT p50, ms per decode step (median of each
    request's mean chunk gap) and that step against the bandwidth floor."""
    ok = [r for r in results if r.status == 200 and not r.error]
    steps = [r.step for r in ok if r.step is not None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    step = statistics.median(steps) if steps else None
    return {
        "concurrency": level,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "tok_s": sum(len(r.chunks) for r in ok) / wall_s if wall_s > 0 else 0.0,
        "ttft_p50_ms": 1e3 * statistics.median(ttfts) if ttfts else None,
        "step_ms": 1e3 * step if step else None,
        "floor_ms": 1e3 * floor_s,
        "step_over_floor": step / floor_s if step and floor_s else None,
    }


def bench(
    url: str,
    model: str,
    weights_bytes: int,
    levels: list[int],
    bw: float,
    prompt_tokens: int = 128,
    output_tokens: int = 64,
) -> list[dict]:
    """For each concurrency: one unmeasured wave, then two measured waves of ``level`` requests
    at once (random token-id prompts, ``ignore_eos``, fixed output length)."""
    rng = random.Random(3)
    floor = weights_bytes / bw
    rows = []
    for level in levels:

        def wave(level: int = level) -> tuple[list[Result], float]:
            bodies = [
                {
                    "model": model,
                    "prompt": [rng.randrange(3, 128000) for _ in range(prompt_tokens)],
                    "max_tokens": output_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                for _ in range(level)
            ]
            t = time.perf_counter()
            res = all_at_once([lambda b=b: stream(url, "/completions", b) for b in bodies])
            return res, time.perf_counter() - t

        wave()
        (a, ta), (b, tb) = wave(), wave()
        rows.append(summarize(level, a + b, ta + tb, floor))
    return rows


def probe(url: str, model: str, n: int = 8, tokens: int = 32) -> list[str]:
    """``n`` greedy completions of fixed random token-id prompts, one at a time (each a batch of one),
    for comparing variants' tokens: a captured and an eager step should agree."""
    rng = random.Random(11)
    texts = []
    for _ in range(n):
        body = {
            "model": model,
            "prompt": [rng.randrange(3, 32000) for _ in range(32)],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        texts.append(stream(url, "/completions", body).text)
    return texts


def print_bench(rows: list[dict], weights_bytes: int, bw: float, label: str = "bf16") -> None:
    print(
        f"{label}: weights {weights_bytes / GiB:.2f} GiB, copy bandwidth {bw / 1e9:.0f} GB/s, "
        f"floor {1e3 * weights_bytes / bw:.2f} ms per decode step"
    )
    print(f"{'conc':>5} {'ok':>4} {'fail':>4} {'tok/s':>9} {'TTFT p50 ms':>12} {'ms/step':>8} {'× floor':>8}")
    for r in rows:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        print(
            f"{r['concurrency']:>5} {r['ok']:>4} {r['failed']:>4} {r['tok_s']:>9.1f} {fmt(r['ttft_p50_ms'], '>12.1f')} "
            f"{fmt(r['step_ms'], '>8.2f')} {fmt(r['step_over_floor'], '>8.2f')}"
        )


# ---- dry run: every piece above on CPU --------------------------------------------------------


def dry_run() -> bool:
    """Check the pieces without a GPU: the random-model folder loads as a tokenizer of the right
    size, the weight bytes match Llama-3-8B, the copy probe runs on CPU, the SSE client and the
    bench summary work against a local stub server, the hog's plan and pick-util's search hold."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        weights = make_model(Path(tmp))
        tok = AutoTokenizer.from_pretrained(tmp)
        assert len(tok) == LLAMA3_8B["vocab_size"], len(tok)
        assert tok.decode(tok("t5 t128255")["input_ids"]) == "t5 t128255"
    assert weights == 2 * 8_030_261_248, weights  # Llama-3-8B's published parameter count
    with tempfile.TemporaryDirectory() as tmp:
        small = make_model(Path(tmp), "smollm2-135m")
        assert len(AutoTokenizer.from_pretrained(tmp)) == SMOLLM2_135M["vocab_size"]
    assert small == 2 * 134_515_008, small  # SmolLM2-135M's parameter count (tied embeddings)
    bw = bandwidth("cpu", mib=64, repeats=3)
    assert bw > 0 and math.isfinite(bw)
    with StubServer() as url:
        rows = bench(url, "m", weights, [1, 3], bw, prompt_tokens=4, output_tokens=5)
        assert [r["ok"] for r in rows] == [2, 6] and all(r["step_ms"] for r in rows), rows
        assert concurrent_stub(url)
        with tempfile.TemporaryDirectory() as tmp:
            folder, record = Path(tmp), Path(tmp) / "runs.json"
            make_model(folder, "smollm2-135m")
            for label in ("bf16", "bf16-eager"):
                ns = argparse.Namespace(
                    url=url, model="m", folder=folder, levels="1", admin=None, label=label, record=record
                )
                assert run_bench(ns)
            assert bench_summary(record)
    plan = grab_plan(3 * GiB + 5 * 2**20)
    assert sum(plan) <= 3 * GiB + 5 * 2**20 - 8 * 2**20 and plan[:3] == [GiB] * 2 + [GiB // 2]
    assert 0 < pick_util(str(Path(__file__).resolve().parents[1] / "deploy.yaml")) <= 1
    print_bench(rows, weights, bw)
    print("dry run: OK")
    return True


def concurrent_stub(url: str) -> bool:
    results = all_at_once([lambda: stream(url, "/chat/completions", {"messages": []}) for _ in range(8)])
    return all(r.status == 200 and r.text == "t1 t2 t3 t4 t5 " and r.finish_reason == "length" for r in results)


class StubServer:
    """A local OpenAI-style SSE server streaming five chunks ("t1 " … "t5 ") per request."""

    def __enter__(self) -> str:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(1, 6):
                    chunk = {"choices": [{"text": f"t{i} ", "finish_reason": "length" if i == 5 else None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.002)
                self.wfile.write(b'data: {"choices": [], "usage": {"completion_tokens": 5}}\n\ndata: [DONE]\n\n')

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dry-run")
    for name in ("concurrent", "near-budget", "oom"):
        p = sub.add_parser(name)
        for arg in ("url", "admin", "model"):
            p.add_argument(arg)
    sub.choices["near-budget"].add_argument("max_model_len", type=int)
    sub.choices["oom"].add_argument("log")
    bench_p = sub.add_parser("bench")
    for arg in ("url", "model"):
        bench_p.add_argument(arg)
    bench_p.add_argument("folder", type=Path)
    bench_p.add_argument("--levels", default="1,8,32,64")
    bench_p.add_argument("--admin", default=None, help="the admin URL: the floor from the weights the worker holds")
    bench_p.add_argument("--label", default="bf16")
    bench_p.add_argument("--record", type=Path, default=None, help="append the rows and a greedy probe to this JSON")
    sub.add_parser("bench-summary").add_argument("record", type=Path)
    sub.add_parser("pick-util").add_argument("deploy")
    sub.add_parser("hog")
    make_p = sub.add_parser("make-model")
    make_p.add_argument("folder", type=Path)
    make_p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    sub.add_parser("bandwidth")
    return ap


def run_bench(a: argparse.Namespace) -> bool:
    """One variant's bench; its floor is the weight bytes its worker reports holding (``--admin``),
    else the bf16 bytes of the folder's shape. ``--record`` appends the rows and a :func:`probe`."""
    import torch

    from worker.contract.shapes import read_json_shape

    bw = bandwidth() if torch.cuda.is_available() else bandwidth("cpu", mib=64, repeats=3)  # the dry run's
    held = workers(a.admin)[0].get("weight_bytes", 0) if a.admin else 0
    weights = held or 2 * read_json_shape(a.folder / "config.json").params
    rows = bench(a.url, a.model, weights, [int(x) for x in a.levels.split(",")], bw)
    print_bench(rows, weights, bw, a.label)
    if a.record:
        runs = json.loads(a.record.read_text()) if a.record.exists() else []
        runs.append({"label": a.label, "weights": weights, "bw": bw, "rows": rows, "probe": probe(a.url, a.model)})
        a.record.write_text(json.dumps(runs))
    return all(r["failed"] == 0 for r in rows)


def bench_summary(record: Path) -> bool:
    """Every recorded variant's rows in one table, and how much of each variant's greedy
    :func:`probe` text agrees with the first variant's (the captured bf16 step)."""
    runs = json.loads(record.read_text())
    print(f"{'variant':>12} {'weights GiB':>11} {'conc':>5} {'tok/s':>9} {'ms/step':>8} {'floor ms':>8} {'× floor':>8}")
    for run in runs:
        for r in run["rows"]:
            step = f"{r['step_ms']:>8.2f}" if r["step_ms"] else f"{'-':>8}"
            ratio = f"{r['step_over_floor']:>8.2f}" if r["step_over_floor"] else f"{'-':>8}"
            print(
                f"{run['label']:>12} {run['weights'] / GiB:>11.2f} {r['concurrency']:>5} {r['tok_s']:>9.1f} "
                f"{step} {r['floor_ms']:>8.2f} {ratio}"
            )
    first = runs[0]
    for run in runs[1:]:
        rates = [match_rate(x, y) for x, y in zip(first["probe"], run["probe"], strict=True)]
        same = sum(r == 1.0 for r in rates)
        print(
            f"greedy probe, {run['label']} vs {first['label']}: {same}/{len(rates)} prompts identical, "
            f"mean agreement {statistics.mean(rates):.2f}"
        )
    return all(r["failed"] == 0 for run in runs for r in run["rows"])


COMMANDS = {
    "dry-run": lambda a: dry_run(),
    "concurrent": lambda a: concurrent(a.url, a.model, a.admin),
    "pick-util": lambda a: print(pick_util(a.deploy)) or True,
    "near-budget": lambda a: near_budget(a.url, a.admin, a.model, a.max_model_len),
    "hog": lambda a: hog() or True,
    "oom": lambda a: oom(a.url, a.admin, a.model, a.log),
    "make-model": lambda a: print(make_model(a.folder, a.shape)) or True,
    "bandwidth": lambda a: print(f"{bandwidth() / 1e9:.1f}") or True,
    "bench": run_bench,
    "bench-summary": lambda a: bench_summary(a.record),
}


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    return 0 if COMMANDS[a.cmd](a) else 1


if __name__ == "__main__":
    sys.exit(main())
