import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from predictor.buckets import BucketScheme, BucketSchemeError

pytestmark = pytest.mark.unit


def test_equal_width_edges_and_assignment():
    s = BucketScheme.equal_width(200, 2048)
    assert s.n == 11
    assert s.edges[:3] == (0, 200, 400)
    assert s.range_of(10) == (2000, 2048)
    assert s.assign([0, 199, 200, 1999, 2000, 5000]).tolist() == [0, 0, 1, 9, 10, 10]


def test_explicit_edges():
    s = BucketScheme.parse("64,128,256", max_tokens=1024)
    assert s.edges == (0, 64, 128, 256)
    assert s.assign([63, 64, 300]).tolist() == [0, 1, 3]
    assert s.range_of(3) == (256, 1024)


@pytest.mark.parametrize("build", [
    lambda: BucketScheme.parse(""),
    lambda: BucketScheme.parse("abc"),
    lambda: BucketScheme.equal_width(4096, 2048),
    lambda: BucketScheme.equal_width(0, 2048),
    lambda: BucketScheme.parse("300,100"),
])
def test_bad_schemes_raise(build):
    with pytest.raises(BucketSchemeError):
        build()


def test_centers_are_bucket_means_and_roundtrip():
    s = BucketScheme.equal_width(100, 400).with_centers(np.array([10, 30, 150, 160, 170]))
    assert s.centers[0] == pytest.approx(20)
    assert s.centers[1] == pytest.approx(160)
    assert s.centers[2] == pytest.approx(250)  # empty bucket keeps its midpoint
    assert BucketScheme.from_dict(s.to_dict()) == s


def test_expected_and_quantile_on_point_mass():
    s = BucketScheme.equal_width(100, 400)
    p = np.array([[0, 1.0, 0, 0]])
    assert s.expected(p)[0] == pytest.approx(150)
    assert s.quantile(p, 0.5)[0] == pytest.approx(150)
    assert s.quantile(p, 0.9)[0] == pytest.approx(190)


probs = st.lists(st.floats(0.001, 1.0), min_size=5, max_size=5).map(lambda v: np.array(v) / sum(v))


@settings(max_examples=200, deadline=None)
@given(p=probs, q1=st.floats(0.01, 0.98), dq=st.floats(0.0, 0.5))
def test_quantile_monotone_and_in_range(p, q1, dq):
    s = BucketScheme.equal_width(100, 500)
    q2 = min(q1 + dq, 0.99)
    a, b = s.quantile(p, q1)[0], s.quantile(p, q2)[0]
    assert 0 <= a <= b <= 500 + 1e-9


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 10_000), min_size=1, max_size=50), width=st.integers(1, 500))
def test_assign_within_bounds(lengths, width):
    s = BucketScheme.equal_width(width, width * 4)
    idx = s.assign(lengths)
    for v, i in zip(lengths, idx):
        lo, hi = s.range_of(int(i))
        assert lo <= v and (v < hi or i == s.n - 1)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=100), bs=st.integers(1, 40), budget=st.integers(64, 4096))
def test_length_batches_cover_each_prompt_once_within_limits(lengths, bs, budget):
    from predictor.runtime import length_batches

    groups = length_batches(lengths, bs, budget)
    flat = sorted(int(i) for g in groups for i in g)
    assert flat == list(range(len(lengths)))
    for g in groups:
        assert len(g) <= bs
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= budget
