"""Every float sampling field rejects non-finite values; any other float either is rejected
with a ValueError naming the field or runs and gives finite log-probabilities."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged import BeamSearchParams, SamplingParams

FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_rejected_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be a finite number"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_beam_length_penalty_must_be_finite(value):
    with pytest.raises(ValueError, match="^length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=value)


@settings(max_examples=40, deadline=None)
@given(
    field=st.sampled_from(FLOAT_FIELDS),
    value=st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True, width=64),
)
def test_any_float_is_rejected_or_runs_with_finite_logprobs(demo_llm, field, value):
    try:
        params = SamplingParams(**{field: value}, max_tokens=2, seed=1, logprobs=2, ignore_eos=True)
    except ValueError as e:
        assert str(e).startswith(field)
        return
    out = demo_llm.generate([[5, 6, 7]], params)[0].outputs[0]
    assert len(out.token_ids) == 2
    assert all(math.isfinite(lp) for pos in out.logprobs for lp in pos.values())
    assert np.isfinite(out.cumulative_logprob)
