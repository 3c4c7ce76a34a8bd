from worker.detok import IncrementalDetokenizer, StopMatcher


class ByteTokenizer:
    """Each token is one UTF-8 byte, so multi-byte characters span tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_never_splits_a_multibyte_character():
    text = "三国 ok 🐉!"
    detok = IncrementalDetokenizer(ByteTokenizer())
    deltas = [detok.add(b) for b in text.encode()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[:3] == ["", "", "三"]


def feed_all(stops, pieces):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        safe, stopped = m.feed(p)
        out.append(safe)
        if stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_stop_across_pieces_is_cut_and_never_leaked():
    m = StopMatcher(["END"])
    assert m.feed("hello E") == ("hello ", False)  # "E" held back
    assert m.feed("N") == ("", False)
    assert m.feed("D tail") == ("", True)


def test_held_text_released_when_not_a_stop():
    assert feed_all(["END"], ["a E", "x", "b"]) == ("a Exb", False)


def test_earliest_stop_wins():
    assert feed_all(["c", "ab"], ["xxab", "c"]) == ("xx", True)


def test_flush_returns_partial_at_end():
    assert feed_all(["STOP"], ["go ST"]) == ("go ST", False)


def test_no_stops_passes_through():
    assert StopMatcher([]).feed("abc") == ("abc", False)
