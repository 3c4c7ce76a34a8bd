"""Tensor parallelism, worker side: N real rank processes over gloo (tests/integration/tp_driver.py)
against one, through the real engine, in float32 on CPU.

Greedy and seeded output must be token-identical to one rank for requests batched, joining a
running batch and leaving it at different lengths, with prompts prefilled in chunks; a rank whose
peer dies (kill -9) exits with worker.tp.PEER_LOST_EXIT_CODE instead of hanging.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.models import resolve_model
from launcher.plan.ports import free_port
from tests.helpers.tiny_models import write_tiny_llama
from worker.tp import PEER_LOST_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three colors.",
    "Tell me a joke about cats.",
    "Who wrote Hamlet?",
    "Explain gravity to a child.",
]
DOCUMENT = "Summarise in one sentence: " + " ".join(
    f"Item {i}: the committee reviewed line {i * 7} and approved {i * 13} units." for i in range(6)
)

# Three requests at once (two greedy, one seeded), two more joining while those decode, a long
# prompt prefilled in 32-token chunks beside them, different lengths so they leave one by one.
SCRIPT = [
    {"submit": "g0", "text": QUESTIONS[0], "params": {"max_tokens": 12, "temperature": 0}},
    {"submit": "g1", "text": QUESTIONS[1], "params": {"max_tokens": 5, "temperature": 0}},
    {"submit": "s0", "text": QUESTIONS[2], "params": {"max_tokens": 10, "temperature": 0.9, "seed": 7}},
    {"steps": 4},
    {"submit": "g2", "text": QUESTIONS[3], "params": {"max_tokens": 8, "temperature": 0}},
    {"submit": "s1", "text": QUESTIONS[4], "params": {"max_tokens": 9, "temperature": 1.0, "top_p": 0.9, "seed": 3}},
    {"steps": 2},
    {"submit": "doc", "text": DOCUMENT, "params": {"max_tokens": 6, "temperature": 0}},
    {"submit": "g3", "text": QUESTIONS[5], "params": {"max_tokens": 4, "temperature": 0}},
]


class Ranks:
    """The processes of one replica: ``world`` ranks of tests/integration/tp_driver.py (or one)."""

    def __init__(self, tmp: Path, name: str, world: int, model: Path, script: list, *extra: str):
        self.out = tmp / f"{name}.json"
        script_file = tmp / f"{name}-script.json"
        script_file.write_text(json.dumps(script))
        common = [sys.executable, "-m", "tests.integration.tp_driver", "--model-path", str(model), *extra]
        if world > 1:
            common += ["--world-size", str(world), "--dist-init", f"tcp://127.0.0.1:{free_port()}"]
        self.procs: list[subprocess.Popen] = []
        for rank in range(world):
            args = [*common, "--rank", str(rank)]
            if rank == 0:
                args += ["--script", str(script_file), "--out", str(self.out)]
            self.procs.append(
                subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )

    def wait(self, timeout: float = TIMEOUT_S) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(max(0.1, deadline - time.monotonic())) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def logs(self) -> str:
        return "\n".join(f"--- rank {i} ---\n{p.stdout.read() if p.stdout else ''}" for i, p in enumerate(self.procs))

    def result(self) -> dict:
        codes = self.wait()
        assert codes == [0] * len(self.procs), self.logs()
        return json.loads(self.out.read_text())


@pytest.fixture(scope="module")
def smollm() -> Path:
    return resolve_model("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="module")
def tiny(smollm, tmp_path_factory) -> Path:
    """A random-initialised Llama config (4 heads, 2 KV heads, MLP 128) with SmolLM2's tokenizer."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm, num_hidden_layers=3)


def assert_continuous_batching(run: dict) -> None:
    """The script did what it says: requests joined a running batch and left it one by one."""
    first, last = run["first_step"], run["last_step"]
    assert first["g2"] > first["g0"] and first["g2"] < last["g0"]  # joined while g0 decoded
    assert last["g1"] < last["g0"]  # left while g0 went on
    assert run["peak_running"] >= 5
    assert not run["failed"]


def test_tp3_smollm_is_token_identical_to_one_rank(smollm, tmp_path):
    one = Ranks(tmp_path, "tp1", 1, smollm, SCRIPT)  # the two replicas run side by side
    three = Ranks(tmp_path, "tp3", 3, smollm, SCRIPT)
    tp3, tp1 = three.result(), one.result()
    assert tp3["kv_heads_per_rank"] == 1 and tp1["kv_heads_per_rank"] == 3
    assert_continuous_batching(tp1)
    assert tp3["first_step"] == tp1["first_step"] and tp3["last_step"] == tp1["last_step"]
    assert tp3["tokens"] == tp1["tokens"]
    assert all(len(tp1["tokens"][rid]) > 0 for rid in ("g0", "g1", "g2", "g3", "s0", "s1", "doc"))


def test_tp2_random_llama_is_token_identical_to_one_rank(tiny, tmp_path):
    """Also: max_prefill_tokens auto is calibrated on rank 0 with rank 1 following its steps; the
    ranks stay joined through an idle spell longer than their step timeout (keep-alives); a
    ~700-token document fills steps whose message does not fit the first broadcast tensor."""
    long_doc = "Summarise: " + " ".join(f"Item {i}: line {i * 7} approved {i * 13} units." for i in range(50))
    script = [
        {"idle": 3.0},
        *SCRIPT,
        {"submit": "long", "text": long_doc, "params": {"max_tokens": 4, "temperature": 0}},
    ]
    flags = ("--random-init", "--max-prefill-tokens", "auto", "--stall-timeout-s", "2")
    one = Ranks(tmp_path, "tp1", 1, tiny, script, *flags)
    two = Ranks(tmp_path, "tp2", 2, tiny, script, *flags)
    tp2, tp1 = two.result(), one.result()
    assert tp2["kv_heads_per_rank"] == 1
    assert len(tp1["tokens"]["long"]) == 4
    assert not tp1["failed"] and not tp2["failed"]
    assert all(len(t) > 0 for t in tp1["tokens"].values())
    assert tp2["tokens"] == tp1["tokens"]


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_whose_peer_is_killed_exits_with_peer_lost(tiny, tmp_path, victim):
    ready = tmp_path / "ready"
    group = Ranks(tmp_path, "tp2", 2, tiny, [{"mark": str(ready)}, {"idle": 60.0}], "--random-init")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in group.procs), group.logs()
            time.sleep(0.1)
        group.procs[victim].send_signal(signal.SIGKILL)
        survivor = group.procs[1 - victim]
        assert survivor.wait(30) == PEER_LOST_EXIT_CODE, group.logs()
    finally:
        group.kill()
