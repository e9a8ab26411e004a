"""The baselines fitted per slice: the later-turn TF-IDF model reads the previous answer's length, C is chosen on the
validation rows, and each test row is predicted by its own slice's model."""

import numpy as np
import pytest

from predictor.buckets import BucketScheme
from training.baselines import C_GRID, GlobalMedian, Rows, TfidfLogReg, fit_sliced, rows_of
from training.data import Example, Turn
from training.evaluate import pairwise_accuracy

pytestmark = pytest.mark.unit
SCHEME = BucketScheme.equal_width(50, 500)
TOPICS = ["poem", "recipe", "essay", "joke", "summary", "email", "story", "list"]


def _examples(n: int, seed: int) -> list[Example]:
    """First turns whose length follows their topic word; later turns whose length follows the previous answer's
    (the words of the request say nothing about it)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        topic = int(rng.integers(len(TOPICS)))
        ask = f"please write a {TOPICS[topic]} about item {int(rng.integers(1000))}"
        if i % 2 == 0:
            out.append(Example(f"c{seed}-{i}", (Turn("user", ask),), response_tokens=int(40 + 50 * topic)))
        else:
            prev = int(rng.integers(5, 400))
            turns = (Turn("user", ask), Turn("assistant", "word " * prev), Turn("user", "go on please"))
            out.append(Example(f"c{seed}-{i}", turns, response_tokens=min(480, prev + 20)))
    return out


def _rows(examples: list[Example]) -> Rows:
    return rows_of(examples, np.array([sum(len(t.text.split()) for t in e.turns) for e in examples]))


@pytest.fixture(scope="module")
def parts() -> tuple[Rows, Rows, Rows]:
    return _rows(_examples(400, 0)), _rows(_examples(120, 1)), _rows(_examples(200, 2))


def test_rows_carry_the_hints_and_the_slice():
    first, later = _examples(2, 0)
    rows = _rows([first, later])
    assert rows.first.tolist() == [True, False]
    assert rows.hints[0, 1] == 0 and rows.hints[1, 1] > 0  # the previous answer's words, as the model's hint rounds them
    assert rows.take(np.array([False, True])).lengths.tolist() == [later.response_tokens]


def test_tfidf_per_slice_ranks_both_slices_and_chooses_c_on_validation(parts):
    train, val, test = parts
    pred, info = fit_sliced(TfidfLogReg, SCHEME, train, val, test)
    for name, mask in (("first_turn", test.first), ("later_turns", ~test.first)):
        assert pairwise_accuracy(pred.point[mask], test.lengths[mask]) > 0.85, name
        assert info[name]["fitted_on"] == "slice" and info[name]["C"] in C_GRID
        assert info[name]["n_train"] == int((train.first == (name == "first_turn")).sum())
    np.testing.assert_allclose(pred.probs.sum(1), 1.0)


def test_the_later_turn_model_needs_the_previous_answers_length(parts):
    # the same request text everywhere, so what the model knows of the previous answer is its hint alone
    later = [Rows(["go on please"] * int((~r.first).sum()), *(a[~r.first] for a in (r.prompt_len, r.hints, r.first,
                                                                                      r.lengths))) for r in parts]
    blind = [Rows(r.texts, r.prompt_len, np.zeros_like(r.hints), r.first, r.lengths) for r in later]
    with_hints = TfidfLogReg().fit(later[0], later[1], SCHEME).predict(later[2])
    without = TfidfLogReg().fit(blind[0], blind[1], SCHEME).predict(blind[2])
    assert pairwise_accuracy(with_hints.point, later[2].lengths) > pairwise_accuracy(without.point, later[2].lengths) + 0.2


def test_a_slice_too_small_to_fit_alone_is_fitted_on_all_rows(parts):
    train, val, test = parts
    few = train.take(train.first | (np.cumsum(~train.first) <= 5))  # five later turns left
    pred, info = fit_sliced(GlobalMedian, SCHEME, few, val, test)
    assert info["later_turns"] == {"fitted_on": "all", "n_train": len(few)}
    assert info["first_turn"]["fitted_on"] == "slice"
    assert set(np.unique(pred.point[~test.first])) == {float(np.median(few.lengths))}
    assert set(np.unique(pred.point[test.first])) == {float(np.median(few.lengths[few.first]))}


def test_one_bucket_in_training_predicts_that_bucket():
    rows = _rows([Example(f"g{i}", (Turn("user", f"say {i}"),), response_tokens=7) for i in range(30)])
    pred = TfidfLogReg().fit(rows, rows, SCHEME).predict(rows)
    assert (pred.probs.argmax(1) == 0).all() and np.allclose(pred.probs.sum(1), 1.0)
