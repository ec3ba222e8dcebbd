from __future__ import annotations

import random

import pytest

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
