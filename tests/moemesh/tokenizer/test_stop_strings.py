from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moemesh.tokenizer import StopStringMatcher


def _run(stops, deltas):
    m = StopStringMatcher(stops)
    out = []
    for d in deltas:
        r = m.feed(d)
        out.append(r.text)
        if r.stopped:
            return "".join(out), r.stop
    return "".join(out) + m.flush(), None


def test_stop_split_across_deltas():
    assert _run(["</s>"], ["Hello </", "s> never"]) == ("Hello ", "</s>")


def test_partial_match_released_when_it_does_not_complete():
    m = StopStringMatcher(["STOP"])
    r = m.feed("abc ST")
    assert (r.text, r.stopped) == ("abc ", False)
    r = m.feed("ART")
    assert (r.text, r.stopped) == ("START", False)


def test_flush_releases_tail():
    assert _run(["xyz"], ["abc x", "y"]) == ("abc xy", None)


def test_first_completed_stop_wins():
    assert _run(["world", "lo"], ["hello world"]) == ("hel", "lo")
    assert _run(["abcd", "bc"], ["abcd"]) == ("a", "bc")


def test_after_stop_emits_nothing():
    m = StopStringMatcher(["."])
    assert m.feed("a.b").text == "a"
    assert m.stopped and m.feed("more").text == "" and m.flush() == ""


def test_no_stops_passes_through():
    assert _run([], ["a", "b"]) == ("ab", None)


@pytest.mark.parametrize("bad", [[""], [None]])
def test_bad_stop(bad):
    with pytest.raises(ValueError, match=r"stops\[0\]"):
        StopStringMatcher(bad)


def test_random_streams_match_reference():
    rng = random.Random(0)
    alphabet = "ab c"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        expected = (text[: min(hits)[1]], True) if hits else (text, False)
        got, stop = _run(stops, deltas)
        assert (got, stop is not None) == expected


def reference(text: str, stops) -> tuple[str, str | None]:
    """The text before the stop string that ends first (the longest of those ending there), and it."""
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, neg_len, stop = min(hits)
    return text[: end + neg_len], stop


def feed_all(stops, deltas):
    """Feeds every delta; checks that nothing emitted can be taken back; returns (text, stop)."""
    m = StopStringMatcher(stops)
    out = ""
    for d in deltas:
        r = m.feed(d)
        out += r.text
        if r.stopped:
            return out, r.stop
    return out + m.flush(), None


alphabet = st.sampled_from("aab\u00e9 ")


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet, max_size=40), stops=st.lists(st.text(alphabet, min_size=1, max_size=6), min_size=1, max_size=5),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_any_split_matches_the_reference(text, stops, cuts):
    bounds = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[i:j] for i, j in zip([0, *bounds], [*bounds, len(text)])]
    assert feed_all(stops, deltas) == reference(text, stops)


def test_held_back_text_is_released_when_it_cannot_become_a_stop():
    m = StopStringMatcher(["abcx", "bcy", "cz"])
    assert m.feed("ab").text == ""  # "ab" may begin abcx
    assert m.feed("c").text == ""  # "abc", "bc", "c" may all go on
    r = m.feed("y")
    assert (r.text, r.stop) == ("a", "bcy")


def test_a_stop_that_is_a_prefix_of_another_matches_first():
    assert feed_all(["ab", "abc"], ["a", "b", "c"]) == ("", "ab")
    assert feed_all(["xaab", "aa"], ["xaab"]) == ("x", "aa")


def test_matching_is_linear_in_the_output():
    """64 stop strings sharing a 16,000-character prefix with the output, diverging 20 times: each
    divergence took 0.3 s of the router's event loop with the quadratic matcher."""
    prefix = "".join("abcdefghij"[(i * 7 + i // 10) % 10] for i in range(16_000))
    stops = [prefix + f"<{i}>" for i in range(64)]
    text = (prefix + "#") * 20
    m = StopStringMatcher(stops)
    started = time.perf_counter()
    emitted = "".join(m.feed(text[i:i + 4]).text for i in range(0, len(text), 4))
    took = time.perf_counter() - started
    assert emitted + m.flush() == text and not m.stopped
    assert took < 3, took  # about 0.4 s here; 10 s with the quadratic matcher
