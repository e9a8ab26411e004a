import json

import numpy as np
import pandas as pd
import pytest

from tests.conftest import ALPACA, SHAREGPT
from tests.datafiles import need_data
from training.data import DataError, load_examples
from training.data.labels import attach_labels, load_counter
from training.data.loaders import sharegpt_examples
from training.split import cap_groups, split_by_group


@pytest.fixture(scope="module")
def sharegpt(data):
    return load_examples(need_data(SHAREGPT), "sharegpt")


def test_sharegpt_one_example_per_answered_human_turn(sharegpt):
    # the data README counts 61,223 human->gpt pairs in the first 17,671 records; 15,000 are kept
    assert 45_000 < len(sharegpt) < 61_223
    first = sharegpt[0]
    assert first.group == "QWJhYvA"
    assert first.turns[-1].role == "user" and first.response
    multi = next(e for e in sharegpt if len(e.turns) >= 3)
    assert [t.role for t in multi.turns[-3:]] == ["user", "assistant", "user"]


@pytest.mark.unit
def test_sharegpt_parts_share_a_group():
    recs = [
        {"id": "abc_0", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"}]},
        {"id": "abc_1", "conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q2"},
                                           {"from": "gpt", "value": "a2"}, {"from": "human", "value": "unanswered"}]},
    ]
    ex = sharegpt_examples(recs)
    assert [e.group for e in ex] == ["abc", "abc"]
    assert [e.response for e in ex] == ["a1", "a2"]
    assert [t.text for t in ex[1].turns] == ["orphan", "q2"]


def test_first_turn_only(data):
    ex = load_examples(need_data(SHAREGPT), "sharegpt", first_turn_only=True)
    assert len({e.group for e in ex}) > 0.9 * len(ex) * 0.5
    assert all(len([t for t in e.turns if t.role == "user"]) == 1 for e in ex[:500])


def test_alpaca_eval_generator(data):
    ex = load_examples(need_data(ALPACA), "alpaca-eval", generator="gpt4_1106_preview")
    assert len(ex) == 805
    assert len({e.group for e in ex}) == 805
    with pytest.raises(DataError, match="available"):
        load_examples(need_data(ALPACA), "alpaca-eval", generator="no-such-model")
    with pytest.raises(DataError, match="--generator is required"):
        load_examples(need_data(ALPACA), "alpaca-eval")


@pytest.mark.unit
def test_jsonl_csv_and_counts(tmp_path):
    rows = [{"prompt": "hi", "response": "hello there"}, {"prompt": "x", "response_tokens": 42, "id": "c1"},
            {"prompt": "", "response": "skipped"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    for fmt, name in (("jsonl", "d.jsonl"), ("csv", "d.csv")):
        ex = load_examples(tmp_path / name, fmt)
        assert len(ex) == 2
        assert ex[1].response_tokens == 42


@pytest.mark.unit
def test_jsonl_messages_are_the_prompt_turns(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "again"}], "response_tokens": 7, "group": "g1"},
            {"prompt": "plain", "response_tokens": 3, "group": "g2"},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "response_tokens": 1}]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    ex = load_examples(tmp_path / "m.jsonl", "jsonl")  # the last row ends on an answer: no prompt, skipped
    assert [(e.group, e.response_tokens, [t.role for t in e.turns]) for e in ex] == [
        ("g1", 7, ["user", "assistant", "user"]), ("g2", 3, ["user"])]
    assert ex[0].latest == "again"


@pytest.mark.unit
def test_hf_dataset_from_local_files(tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.jsonl").write_text("\n".join(json.dumps({"prompt": f"p{i}", "response": "r " * i}) for i in range(1, 6)))
    ex = load_examples(str(d), "hf")
    assert len(ex) == 5


@pytest.mark.unit
@pytest.mark.parametrize("content,fmt,match", [
    (None, "sharegpt", "not found"),
    ("not json", "sharegpt", "not a ShareGPT"),
    ("[]", "sharegpt", "no usable"),
    ('{"a": 1}\n', "jsonl", "needs a 'prompt' column"),
    ("{broken\n", "jsonl", "not valid JSON"),
    ('{"instruction": "x"}\n', "alpaca-eval", "not AlpacaEval"),
])
def test_bad_files(tmp_path, content, fmt, match):
    p = tmp_path / "f"
    if content is not None:
        p.write_text(content)
    with pytest.raises(DataError, match=match):
        load_examples(p, fmt)


def test_token_counts_with_real_tokenizers(data):
    t = {name: need_data(f"tokenizers/{name}") for name in
         ("gpt2/tokenizer.json", "llama3/tokenizer.model", "llama2/tokenizer.model", "mistral_v1/tokenizer.model")}
    assert load_counter(t["gpt2/tokenizer.json"]).count(["Hello world"]).tolist() == [2]
    assert load_counter(t["llama3/tokenizer.model"]).count(["Hello world, this is a test."]).tolist() == [8]
    sp = load_counter(t["llama2/tokenizer.model"]).count(["Hello world"])
    assert sp.tolist() == [2]
    assert load_counter(t["mistral_v1/tokenizer.model"]).count(["Hello world"])[0] >= 2
    from predictor.model import default_backbone_path

    assert load_counter(default_backbone_path()).count(["hello world"]).tolist() == [2]
    with pytest.raises(DataError, match="tokenizer not found"):
        load_counter(data / "nope.json")
    bad = need_data(SHAREGPT)  # exists, but is not a tokenizer
    with pytest.raises(DataError, match="unknown or unreadable tokenizer"):
        load_counter(bad)


def test_labels_and_split_without_leakage(sharegpt, data):
    ex = cap_groups(sharegpt, 4000, seed=1)
    assert len(ex) == 4000
    attach_labels(ex, load_counter(need_data("tokenizers/gpt2/tokenizer.json")))
    assert all(e.response_tokens > 0 for e in ex)
    s1, s2 = split_by_group(ex, seed=3), split_by_group(ex, seed=3)
    assert s1.fingerprint() == s2.fingerprint()
    groups = [{e.group for e in part} for part in (s1.train, s1.val, s1.test)]
    assert not (groups[0] & groups[1]) and not (groups[0] & groups[2]) and not (groups[1] & groups[2])
    assert len(s1.train) + len(s1.val) + len(s1.test) == len(ex)
    assert 0.05 < len(s1.test) / len(ex) < 0.15
    assert split_by_group(ex, seed=4).fingerprint() != s1.fingerprint()
    lens = np.array([e.response_tokens for e in ex])
    assert 200 < np.median(lens) < 350  # data README: all-turn median 276 GPT-2 tokens
