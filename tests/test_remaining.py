"""Remaining-length examples: the prompt and the answer so far, labelled with what is left of the answer."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from tokenizers import Tokenizer

from predictor.partial import ANSWER_HEAD_CHARS, answer_so_far, with_answer
from tests.datafiles import need_data
from training.data.loaders import table_examples
from training.remaining import Answer, example_rows, served_answers

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def gpt2() -> Tokenizer:
    return Tokenizer.from_file(str(need_data("tokenizers/gpt2/tokenizer.json")))


def test_every_answer_gives_a_row_at_each_point_it_is_still_running_at(gpt2):
    ids = gpt2.encode("Sure! Here are ten ways to keep a sourdough starter alive through the winter. " * 3).ids
    a = Answer("conv-1", (("user", "How do I keep a sourdough starter?"),), tuple(ids), False, "SmolLM2-135M-Instruct")
    rows = example_rows([a], gpt2, ks=(0, 16, 32, 64))
    assert [r["generated_tokens"] for r in rows] == [0, 16, 32]  # 64 > the answer's length: it has ended there
    assert [r["response_tokens"] for r in rows] == [len(ids), len(ids) - 16, len(ids) - 32]
    assert rows[0]["messages"] == [{"role": "user", "content": "How do I keep a sourdough starter?"}]
    last = rows[2]["messages"][-1]
    assert last["role"] == "assistant" and last["content"].startswith("[32 tokens written] Sure! Here are ten ways")
    # train-predictor reads them: the answer so far is the latest turn, after the request
    exs = table_examples(pd.DataFrame(rows), "rows")
    assert len(exs) == 3 and exs[2].turns[-1].role == "assistant" and exs[2].response_tokens == len(ids) - 32
    assert all(e.first_turn for e in exs)


def test_a_trailing_answer_is_refused_without_its_token_count():
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "response_tokens": 3}
    assert table_examples(pd.DataFrame([row, {**row, "generated_tokens": 4}]), "rows")[0].turns[-1].role == "assistant"
    assert len(table_examples(pd.DataFrame([row]), "rows")) == 0


def test_a_long_answer_so_far_keeps_its_head_and_tail():
    text = "A" * 500 + "Z" * 500
    s = answer_so_far(text, 300)
    assert s.startswith("[300 tokens written] " + "A" * ANSWER_HEAD_CHARS) and s.endswith("Z" * 200) and " ... " in s
    assert with_answer([("user", "q")], "anything", 0) == [("user", "q")]


def test_served_answers_need_relabel_answers(tmp_path):
    line = {"group": "g", "messages": [{"role": "user", "content": "q"}], "answer_ids": [1, 2, 3], "censored": True,
            "model": "SmolLM2-135M-Instruct@ab8dfd91286b"}
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(line) + "\n")
    (a,) = served_answers(p)
    assert a.ids == (1, 2, 3) and a.censored and a.model == "SmolLM2-135M-Instruct"
    p.write_text(json.dumps({k: v for k, v in line.items() if k != "answer_ids"}) + "\n")
    with pytest.raises(ValueError, match="--answers"):
        served_answers(p)
