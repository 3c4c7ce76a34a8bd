"""The perplexity arithmetic of ``bench --perplexity`` on known logprobs (llama-perplexity's method)."""

from __future__ import annotations

import math

import pytest

from launcher.bench.perplexity import TooShort, estimate, scored, windows


def test_windows_are_non_overlapping_whole_contexts_with_bos_first():
    tokens = list(range(1100))
    ws = windows(tokens, 512, bos=None)
    assert ws == [tokens[:512], tokens[512:1024]]  # the 76 left over are dropped
    with_bos = windows(tokens, 512, bos=7)
    assert [w[0] for w in with_bos] == [7, 7] and with_bos[1][1:] == tokens[513:1024]
    assert len(windows(tokens, 512, bos=None, limit=1)) == 1
    with pytest.raises(TooShort, match="1023 tokens; a context of 512 needs at least 1024"):
        windows(tokens[:1023], 512, bos=None)


def test_only_the_second_half_of_a_window_is_scored():
    lps = [None, -9.0, -9.0, -9.0, -9.0, -1.0, -2.0, -3.0]  # ctx 8: first = 4, tokens 5..7 scored
    assert scored(lps, 8) == [1.0, 2.0, 3.0]
    assert len(scored([None] + [-1.0] * 511, 512)) == 512 - 256 - 1
    with pytest.raises(ValueError, match="7 logprobs for a window of 8"):
        scored(lps[:7], 8)


def test_estimate_matches_llama_cpp_formula():
    est = estimate([1.0, 2.0, 3.0])
    assert est.ppl == pytest.approx(math.e**2) and est.count == 3
    # sqrt((mean(nll^2) - mean^2) / (count - 1)) * ppl = sqrt((14/3 - 4) / 2) * e^2
    assert est.error == pytest.approx(math.sqrt(1 / 3) * math.e**2)
    assert estimate([0.5] * 10).error == 0.0


def test_a_uniform_model_has_the_vocabulary_size_as_perplexity():
    vocab = 49152
    lps = [None] + [-math.log(vocab)] * 63
    assert estimate(scored(lps, 64) * 3).ppl == pytest.approx(vocab)


def test_tokenize_url_takes_llama_cpp_token_ids_and_refuses_a_bad_answer(monkeypatch):
    import httpx
    import typer

    from launcher.bench import perplexity_run
    from launcher.bench.perplexity_run import peer_token_ids

    asked = []

    def post(url, json, **_):
        asked.append((url, json))
        tokens = {"good": [5, 6, 7], "bad": ["a", 1]}[json["content"]]
        return httpx.Response(200, json={"tokens": tokens}, request=httpx.Request("POST", url))

    monkeypatch.setattr(perplexity_run.httpx, "post", post)
    assert peer_token_ids("http://127.0.0.1:8400/v1", "good", 5) == [5, 6, 7]
    # llama-perplexity tokenizes with its special tokens (BOS when the model file adds one)
    assert asked == [("http://127.0.0.1:8400/tokenize", {"content": "good", "add_special": True})]
    with pytest.raises(typer.Exit) as exc:
        peer_token_ids("http://127.0.0.1:8400", "bad", 5)
    assert exc.value.exit_code == 2

    def refused(url, **_):
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(perplexity_run.httpx, "post", refused)
    with pytest.raises(typer.Exit):
        peer_token_ids("http://127.0.0.1:8400", "good", 5)
