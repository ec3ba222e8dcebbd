import pytest

from moemesh.engine import SamplingParams


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_context_check():
    p = SamplingParams(max_new_tokens=10)
    p.check_fits(90, 100)
    with pytest.raises(ValueError, match="max_new_tokens"):
        p.check_fits(91, 100)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        p.check_fits(100, 100)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        p.check_fits(0, 100)


def test_greedy_flag():
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy
