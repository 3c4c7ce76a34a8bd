"""What cache-aware routing saves: one document asked again and again on a running deployment,
under each routing policy in turn.

``python -m launcher.bench.affinity [--url U] [--admin-url A] [--admin-token T] [--repeats N]``
switches the deployment's policy through the admin API (``POST /admin/policy``), sends a fresh
~1,500-token document ``N`` times one after another (a 1-token answer, so the time is the
prefill), and prints each attempt's latency and the mean repeat's ratio to the first, for each
registered policy (:mod:`router.policies.registry`: ``least_loaded``, cache-aware among idle
workers; ``round_robin``, strict rotation; ``cache_aware``). On a deployment of several replicas the rotation sends a
repeat to a worker that has not seen the document; the policy in force before is set back at
the end.
"""

from __future__ import annotations

import argparse
import time

import httpx

from launcher.bench.client import first_generative
from router.policies.registry import POLICIES


def document(tag: str, clauses: int = 45) -> str:
    """A contract-like document of ``clauses`` numbered clauses (45: ~1,500 SmolLM2 tokens with the
    chat template), distinct per ``tag`` so no earlier run's cache can serve it."""
    return " ".join(
        f"Clause {i} ({tag}): the supplier delivers lot {i * 7} of part {tag}-{i} by week {i % 52}."
        for i in range(clauses)
    )


def summary(policy: str, prompt_tokens: int, seconds: list[float]) -> str:
    """One line: the attempts' latencies and the mean repeat's ratio to the first attempt."""
    repeats = seconds[1:]
    ratio = (sum(repeats) / len(repeats)) / seconds[0] if repeats and seconds[0] > 0 else float("nan")
    times = " ".join(f"{s:.2f}" for s in seconds)
    return f"{policy:>12}: {prompt_tokens} prompt tokens, latencies {times} s; repeats / first = {ratio:.2f}x"


def run(url: str, admin_url: str, token: str | None, repeats: int, model: str | None) -> list[str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=300) as http:
        before = http.get(f"{admin_url}/admin/workers", headers=headers).raise_for_status().json()["policy"]
        model = model or first_generative(http.get(f"{url}/models").raise_for_status().json())
        lines = []
        try:
            for policy in POLICIES:
                http.post(f"{admin_url}/admin/policy", json={"policy": policy}, headers=headers).raise_for_status()
                text = f"Summarise in five words.\n\n{document(f'{policy[:2]}{int(time.time()) % 10000}')}"
                seconds, tokens = [], 0
                for _ in range(repeats):
                    start = time.monotonic()
                    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
                    reply = http.post(f"{url}/chat/completions", json=body).raise_for_status().json()
                    seconds.append(time.monotonic() - start)
                    tokens = reply["usage"]["prompt_tokens"]
                lines.append(summary(policy, tokens, seconds))
        finally:
            http.post(f"{admin_url}/admin/policy", json={"policy": before}, headers=headers)
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the deployment's OpenAI base URL")
    ap.add_argument("--admin-url", default="http://127.0.0.1:8001", help="its admin API")
    ap.add_argument("--admin-token", default=None, help="router.admin_token, when set")
    ap.add_argument("--model", default=None, help="default: the first model of GET /models that generates")
    ap.add_argument("--repeats", type=int, default=4, help="times each document is sent (≥ 2)")
    args = ap.parse_args(argv)
    if args.repeats < 2:
        ap.error("--repeats must be at least 2")
    for line in run(args.url, args.admin_url, args.admin_token, args.repeats, args.model):
        print(line)


if __name__ == "__main__":
    main()
