"""``lengthwise bench model-lengths`` on the real AlpacaEval answers of two models: the split by instruction, the
predictors' rows, and bad input in one line."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from predictor.conditioning import conditioned_text
from serving.bench.predictor.models import load_answers
from serving.cli import main
from tests.cli_inproc import run_main
from tests.datafiles import need_data

TWO = "alpaca-7b,gpt4"  # a terse and a verbose answerer (mean about 100 and 250 GPT-2 tokens)


@pytest.fixture(scope="module")
def answers(data):
    return load_answers(need_data("prompts/alpaca_eval_model_outputs.62models.jsonl.xz"),
                        need_data("tokenizers/gpt2/tokenizer.json"), TWO.split(","))


@pytest.fixture(scope="module")
def report(data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("model-lengths") / "ml.json"
    r = run_main(main, ["bench", "model-lengths", "--data", str(need_data("prompts/alpaca_eval_model_outputs.62models.jsonl.xz")),
                        "--models", TWO, "--json", str(out)])
    assert r.returncode == 0, r.stderr
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


def test_the_predictors_rank_within_and_across_models_on_a_sample(answers):
    """The same code as the bench on a fifth of the instructions (seconds, not a minute): each predictor's row per model
    and across them, the model's mean ranking nothing inside a model."""
    from predictor.buckets import BucketScheme
    from serving.bench.predictor.models import predict_all, score

    sample = answers.take(np.array([zlib.crc32(g.encode()) % 5 == 0 for g in answers.groups]) | (answers.split == "test"))
    scheme = BucketScheme.equal_width(200, 2048)
    points = predict_all(sample, scheme)
    assert set(points) == {"model-mean", "tfidf", "tfidf-pooled", "tfidf-conditioned"}
    r = score(sample, points, scheme)
    n_test = int((sample.split == "test").sum())
    assert all(r["across_models"][name]["n"] == n_test for name in points)
    assert r["summary"]["model-mean"]["mean_tau"] == 0.0 < r["across_models"]["model-mean"]["kendall_tau"]
    assert set(r["per_model"]) == {"alpaca-7b", "gpt4"} and r["summary"]["tfidf"]["models"] == 2


@pytest.mark.slow
def test_every_predictor_is_scored_per_model_and_across_models(report):
    assert set(report["per_model"]) == {"alpaca-7b", "gpt4"}
    names = {"model-mean", "tfidf", "tfidf-pooled", "tfidf-conditioned"}
    assert set(report["summary"]) == set(report["across_models"]) == names
    assert report["per_model"]["gpt4"]["mean_length"] > report["per_model"]["alpaca-7b"]["mean_length"]
    # SeaLLM's profile ranks nothing inside a model, and across the two only as far as their means differ
    assert report["summary"]["model-mean"]["mean_tau"] == 0.0 and report["across_models"]["model-mean"]["kendall_tau"] > 0
    # a predictor blind to the model ranks the two models' answers worse in one queue than it does each model's
    assert report["across_models"]["tfidf-pooled"]["kendall_tau"] < report["across_models"]["tfidf-conditioned"]["kendall_tau"]
    for name in names:
        assert report["across_models"][name]["n"] == report["config"]["rows"]["test"]
        assert all(0 <= report["per_model"][m][name]["accuracy"] <= 1 for m in ("alpaca-7b", "gpt4"))


def test_no_test_instruction_is_in_training_for_any_model(answers):
    test = {g for g, s in zip(answers.groups, answers.split) if s == "test"}
    train = {g for g, s in zip(answers.groups, answers.split) if s == "train"}
    assert test and train and not test & train
    assert set(answers.split) == {"train", "val", "test"} and np.all(answers.lengths > 0)


def test_the_conditioned_rows_split_in_train_predictor_as_in_the_bench(data, answers, tmp_path):
    out = tmp_path / "cond.jsonl"
    r = run_main(main, ["bench", "model-lengths", "--data", str(need_data("prompts/alpaca_eval_model_outputs.62models.jsonl.xz")),
                        "--models", TWO, "--write-conditioned", str(out)])
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == len(answers.lengths)
    assert {r["model"] for r in rows} == {"alpaca-7b", "gpt4"} and conditioned_text("m", "x") == "[m] x"
    from training.config import TrainConfig
    from training.data import DataError
    from training.pipeline import prepare

    # train-predictor's own split, each request read after its model's name, as the bench's conditioned TF-IDF reads it
    prep = prepare(TrainConfig(data=str(out), fmt="jsonl", max_samples=None, condition_on_model=True))
    test = {g for g, s in zip(answers.groups, answers.split) if s == "test"}
    assert {e.group for e in prep.splits.test} == test and not {e.group for e in prep.splits.train} & test
    assert prep.models == ["alpaca-7b", "gpt4"]
    assert all(e.latest.startswith(f"[{e.model}] ") for e in prep.splits.train)
    with pytest.raises(DataError, match="--condition-on-model"):  # several models' lengths, not conditioned: refused
        prepare(TrainConfig(data=str(out), fmt="jsonl", max_samples=None))
    (tmp_path / "anon.jsonl").write_text(json.dumps({"prompt": "hi", "response_tokens": 3}) + "\n")
    with pytest.raises(DataError, match="'model' column"):
        prepare(TrainConfig(data=str(tmp_path / "anon.jsonl"), fmt="jsonl", condition_on_model=True))


@pytest.mark.parametrize("args,said", [
    (["--models", "alpaca-7b,nobody"], "--models: nobody not in"),
    (["--models", "1"], "--models N needs N >= 2"),
    (["--data", "/nowhere.jsonl.xz"], "/nowhere.jsonl.xz not found"),
    (["--conditioned-package", "/nowhere"], "--conditioned-package /nowhere: not a directory"),
    (["--bucket-width", "0"], "--bucket-width must be >= 1"),
    (["--relabelled", "base=/nowhere.jsonl"], "--relabelled base: /nowhere.jsonl not found"),
    (["--relabelled", "base"], "--relabelled 'base': give NAME=FILE"),
    (["--folds", "2"], "--folds takes K >= 3"),
])
def test_bad_input_exits_2_in_one_line(data, args, said):
    need_data("prompts/alpaca_eval_model_outputs.62models.jsonl.xz")  # the default --data
    r = run_main(main, ["bench", "model-lengths", *args], env={"LENGTHWISE_DATA": str(data), "PATH": "/usr/bin"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr


def _relabel_file(path, prompts, lengths) -> None:
    """What ``lengthwise relabel`` writes (the fields the join reads): two samples of each prompt."""
    path.write_text("".join(json.dumps({"prompt_hash": h, "sample": s, "response_tokens": n, "model": path.stem,
                                        "sampling": None, "max_tokens": 512, "censored": n == 512}) + "\n"
                            for h, (a, b) in zip(prompts, lengths) for s, n in enumerate((a, b))))


def test_relabelled_files_give_a_row_per_model_and_prompt_they_all_labelled(tmp_path):
    from serving.bench.predictor.models import load_relabelled, relabelled_files
    from training.data.loaders import load_examples
    from training.data.served import prompt_hash

    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                               {"from": "gpt", "value": "an answer"}]} for i in range(40)]
    (tmp_path / "p.json").write_text(json.dumps(convs))
    hashes = [prompt_hash(e.turns) for e in load_examples(str(tmp_path / "p.json"), "sharegpt")]
    _relabel_file(tmp_path / "base.jsonl", hashes, [(300 + i, 512) for i in range(40)])
    _relabel_file(tmp_path / "terse.jsonl", hashes[:30], [(10, 20)] * 30)  # relabelled on the first 30 only
    files = relabelled_files(f"base={tmp_path / 'base.jsonl'},terse={tmp_path / 'terse.jsonl'}")
    a = load_relabelled(files, tmp_path / "p.json")
    assert list(a.models) == ["base"] * 40 + ["terse"] * 30  # every labelled prompt trains ...
    assert a.scored.tolist() == [True] * 30 + [False] * 10 + [True] * 30  # ... those both labelled are scored
    assert a.lengths[0] == (300 + 512) / 2 and a.lengths[40] == 15  # each prompt's samples averaged
    assert a.groups[:40] == [f"c{i}" for i in range(40)] and a.groups[40:] == [f"c{i}" for i in range(30)]
    assert a.split[:30].tolist() == a.split[40:].tolist()  # a prompt's split is its conversation's
    assert "test" not in a.split[30:40].tolist()  # a prompt one model lacks is never a test row
    with pytest.raises(ValueError, match="two models or more"):
        relabelled_files(f"base={tmp_path / 'base.jsonl'}")


def test_folds_score_every_relabelled_row_with_predictors_that_never_saw_its_prompt(tmp_path):
    from training.data.loaders import load_examples
    from training.data.served import prompt_hash

    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"{'explain at length' if i % 2 else 'name'} "
                                                                           f"thing {i}"},
                                               {"from": "gpt", "value": "an answer"}]} for i in range(60)]
    (tmp_path / "p.json").write_text(json.dumps(convs))
    hashes = [prompt_hash(e.turns) for e in load_examples(str(tmp_path / "p.json"), "sharegpt")]
    _relabel_file(tmp_path / "base.jsonl", hashes, [(400, 420) if i % 2 else (90, 110) for i in range(60)])
    _relabel_file(tmp_path / "terse.jsonl", hashes, [(30, 40) if i % 2 else (10, 12) for i in range(60)])
    out = tmp_path / "ml.json"
    files = f"base={tmp_path / 'base.jsonl'},terse={tmp_path / 'terse.jsonl'}"
    r = run_main(main, ["bench", "model-lengths", "--relabelled", files, "--prompts", str(tmp_path / "p.json"), "--folds", "5",
                        "--bucket-width", "50", "--max-tokens", "600", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["config"]["split"] == "5 folds of conversations" and report["config"]["rows"]["test"] == 120
    assert report["across_models"]["model-mean"]["n"] == 120  # every row, each predicted out of its fold
    assert report["per_model"]["base"]["mean_length"] == 255 and report["per_model"]["terse"]["mean_length"] == 23
    # the means rank the two models apart and nothing within one (beyond each fold's own mean); the prompt's words rank
    # within each as well
    assert abs(report["per_model"]["base"]["model-mean"]["kendall_tau"]) < 0.2
    assert report["per_model"]["base"]["tfidf"]["kendall_tau"] > 0.5
    assert report["across_models"]["tfidf-conditioned"]["kendall_tau"] > report["across_models"]["model-mean"]["kendall_tau"]
