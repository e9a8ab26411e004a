"""Training on the served model's own lengths: what the file says about its labels (the target), soft labels from a
prompt's K samples, censored samples, the ranking term, and one small real run through train-predictor."""

from __future__ import annotations

import json
import lzma
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from predictor.buckets import BucketScheme
from tests.datafiles import need_data
from training.cli import main
from training.config import TrainConfig
from training.data import DataError, Example, Turn, load_examples
from training.data.served import group_samples, load_served, prompt_hash
from training.module import censored_cross_entropy, pairwise_rank_loss
from training.pipeline import _target, label_targets

MODEL = "Tiny-Instruct@0123456789ab"
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}


def _record(h: str, group: str, sample: int, n: int, cap: int, model: str = MODEL) -> dict:
    return {"prompt_hash": h, "group": group, "turn": 0, "first_turn": True, "sample": sample, "seed": sample,
            "response_tokens": min(n, cap), "finish_reason": "length" if n >= cap else "stop", "censored": n >= cap,
            "prompt_tokens": 0, "model": model, "sampling": SAMPLING, "max_tokens": cap}


def _write(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture(scope="module")
def served_set(data, tmp_path_factory) -> tuple[Path, Path]:
    """The first 160 ShareGPT conversations (first and later turns) and two seeded samples of every prompt, whose
    lengths follow the request (first turns) or the previous answer (later turns), up to a cap of 256."""
    d = tmp_path_factory.mktemp("served")
    with lzma.open(need_data("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"), "rt") as f:
        convs = json.load(f)[:160]
    prompts = d / "set.json"
    prompts.write_text(json.dumps(convs))
    rng, recs, seen = random.Random(0), [], set()
    for e in load_examples(prompts, "sharegpt"):
        h = prompt_hash(e.turns)
        if h in seen:
            continue
        seen.add(h)
        prev = next((len(t.text.split()) for t in reversed(e.turns[:-1]) if t.role == "assistant"), None)
        base = 30 + 2 * len(e.latest.split()) if prev is None else prev
        recs += [_record(h, e.group, s, max(1, int(base * rng.uniform(0.6, 1.4))), 256) for s in range(2)]
    return prompts, _write(d / "lengths.jsonl", recs)


@pytest.mark.unit
def test_the_file_says_whose_lengths_they_are_and_refuses_a_mixture(tmp_path):
    recs = [_record("a" * 64, "g", 0, 12, 64), _record("a" * 64, "g", 1, 80, 64), _record("b" * 64, "h", 0, 5, 64)]
    labels = load_served(_write(tmp_path / "one.jsonl", recs))
    assert labels.lengths == {"a" * 64: [12, 64], "b" * 64: [5]} and labels.censored == 1
    assert labels.target() == {"model": MODEL, "label_tokenizer": "served model's own output tokens",
                               "sampling": SAMPLING, "max_tokens": 64, "source": "relabel by the served model"}
    mixed = _write(tmp_path / "two.jsonl", [*recs, _record("c" * 64, "i", 0, 5, 64, model="Other@ba9876543210")])
    with pytest.raises(DataError, match="mixes labels of 2 set-ups"):
        load_served(mixed)


@pytest.mark.unit
def test_dataset_answers_are_recorded_as_such(data):
    tok = str(need_data("tokenizers/gpt2/tokenizer.json"))
    cfg = TrainConfig(data="x.json", fmt="alpaca-eval", generator="gpt4", tokenizer=tok, max_tokens=1024)
    assert _target(cfg, None) == {"model": "dataset answers (gpt4)", "label_tokenizer": "tokenizer.json",
                                  "sampling": None, "max_tokens": 1024, "source": "dataset answers"}
    assert _target(TrainConfig(data="x.json", tokenizer=tok), None)["model"] == "dataset answers (sharegpt)"


@pytest.mark.unit
def test_a_jsonl_dataset_whose_rows_name_their_model_records_that_model(data, tmp_path):
    tok = str(need_data("tokenizers/gpt2/tokenizer.json"))
    rows = [{**_record("a" * 64, "g", s, 20 + s, 64), "messages": [{"role": "user", "content": "hi"}]} for s in range(2)]
    named = _write(tmp_path / "relabelled.jsonl", rows)  # what `lengthwise relabel` writes with the text
    assert _target(TrainConfig(data=str(named), fmt="jsonl", tokenizer=tok), None) == load_served(named).target()
    fed = _write(tmp_path / "feedback.jsonl", [{**r, "sampling": None, "max_tokens": None, "source": "feedback"}
                                               for r in rows])
    assert _target(TrainConfig(data=str(fed), fmt="jsonl", tokenizer=tok), None)["source"] == "feedback"
    plain = _write(tmp_path / "logs.jsonl", [{"prompt": "hi", "response_tokens": 3}])
    assert _target(TrainConfig(data=str(plain), fmt="jsonl", tokenizer=tok), None)["model"] == "dataset answers (jsonl)"
    mixed = _write(tmp_path / "mixed.jsonl", [rows[0], {**rows[1], "model": "Other@ba9876543210"}])
    with pytest.raises(DataError, match="mixes lengths of 2 set-ups"):
        _target(TrainConfig(data=str(mixed), fmt="jsonl", tokenizer=tok), None)


@pytest.mark.unit
def test_soft_labels_are_each_prompts_bucket_histogram():
    scheme = BucketScheme.equal_width(100, 400)
    a, b = (Turn("user", "a"),), (Turn("user", "b"),)
    rows = [Example("g1", a, response_tokens=n) for n in (10, 150, 170)] + [Example("g2", b, response_tokens=400)]
    rows.append(Example("g2", b, response_tokens=120, censored=True))
    grouped = group_samples(rows)
    assert [(e.turns, [n for n, _ in s]) for e, s in grouped] == [(a, [10, 150, 170]), (b, [400, 120])]
    targets = label_targets([s for _, s in grouped], scheme)
    # exact shares, then the shares cut inside each bucket (lower bounds)
    np.testing.assert_allclose(targets, [[1 / 3, 2 / 3, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1 / 2, 0, 1 / 2, 0, 0]])
    capped = label_targets([[(350, True)]], scheme)  # cut inside the open last bucket: its bucket is known
    np.testing.assert_allclose(capped, [[0, 0, 0, 1, 0, 0, 0, 0]])


@pytest.mark.unit
def test_a_cut_answer_trains_as_a_lower_bound_not_as_a_short_answer():
    logits = torch.tensor([[2.0, 0.5, 0.1, -1.0], [0.0, 1.0, 0.0, 0.3]])
    exact = torch.nn.functional.one_hot(torch.tensor([0, 3]), 4).float()
    # no censored weight: the ordinary cross-entropy
    no_cut = torch.cat([exact, torch.zeros(2, 4)], 1)
    assert torch.isclose(censored_cross_entropy(logits, no_cut), torch.nn.functional.cross_entropy(logits, torch.tensor([0, 3])))
    # a bound in bucket 1 is the likelihood of P(bucket >= 1), less than the loss of the exact bucket 1
    bound = torch.tensor([[0, 0, 0, 0, 0, 1.0, 0, 0]])
    p = logits[:1].softmax(1)[0]
    assert torch.isclose(censored_cross_entropy(logits[:1], bound), -torch.log(p[1:].sum()))
    # its gradient moves mass from below the bound to above it, and never lowers a bucket above the bound
    x = logits[:1].clone().requires_grad_(True)
    censored_cross_entropy(x, bound).backward()
    assert x.grad[0, 0] > 0 and (x.grad[0, 1:] < 0).all()
    # a bound in the last bucket equals the exact label there
    last = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1.0]])
    ce = torch.nn.functional.cross_entropy(logits[:1], torch.tensor([3]))
    assert torch.isclose(censored_cross_entropy(logits[:1], last), ce)


@pytest.mark.unit
def test_a_pair_whose_shorter_answer_was_cut_has_no_order():
    length = torch.tensor([300.0, 100.0])
    wrong = torch.tensor([0.0, 3.0])  # ranks the 100-token answer first
    assert pairwise_rank_loss(wrong, length) > 1.0
    assert pairwise_rank_loss(wrong, length, torch.tensor([False, True])) == 0  # 100 was cut: it may be longer than 300
    assert pairwise_rank_loss(wrong, length, torch.tensor([True, False])) > 1.0  # 300+ is longer than 100 either way


@pytest.mark.unit
def test_tables_and_served_files_mark_cut_answers(tmp_path):
    rows = [{"prompt": "a", "response_tokens": 5, "finish_reason": "stop"},
            {"prompt": "b", "response_tokens": 9, "finish_reason": "length"},
            {"prompt": "c", "response_tokens": 7, "censored": True},
            {"prompt": "d", "response_tokens": 8}]
    examples = load_examples(str(_write(tmp_path / "t.jsonl", rows)), "jsonl")
    assert [e.censored for e in examples] == [False, True, True, False]
    served = load_served(_write(tmp_path / "s.jsonl", [_record("h", "g", 0, 50, 40), _record("h", "g", 1, 30, 40)]))
    assert served.cut == {"h": [True, False]} and served.censored == 1


@pytest.mark.unit
def test_the_ranking_term_rewards_the_true_order():
    length = torch.tensor([10.0, 200.0, 50.0, 50.0])
    right = pairwise_rank_loss(torch.tensor([0.1, 2.0, 0.5, 0.5]), length)
    wrong = pairwise_rank_loss(torch.tensor([2.0, 0.1, 0.5, 0.5]), length)
    assert right < wrong
    score = torch.tensor([1.0, 0.0, 0.5, 0.5], requires_grad=True)
    pairwise_rank_loss(score, length).backward()
    assert score.grad[1] < 0 < score.grad[0]  # a step against the gradient lifts the longest and lowers the shortest
    assert pairwise_rank_loss(torch.tensor([1.0, 2.0]), torch.tensor([7.0, 7.0])) == 0


def _fail_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:  # argparse's own exit
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_label_settings_exit_2_with_one_line(served_set, data, capsys, home):
    prompts, lengths = served_set
    tok = ["--tokenizer", str(need_data("tokenizers/gpt2/tokenizer.json"))]
    assert main(["--data", str(prompts), *tok, "--label", "soft"]) == 2
    assert capsys.readouterr().err.strip() == ("train-predictor: error: --label soft needs --served-lengths: soft labels "
                                               "are the bucket histogram of a prompt's samples")
    assert main(["--data", str(prompts), *tok, "--pretrain-epochs", "1"]) == 2
    assert capsys.readouterr().err.strip() == ("train-predictor: error: --pretrain-epochs needs --served-lengths: without "
                                               "them the data's answers are the labels already")
    assert main(["--data", str(prompts), *tok, "--served-lengths", str(lengths), "--finetune-lr", "1e-4"]) == 2
    assert capsys.readouterr().err.strip() == ("train-predictor: error: --finetune-lr is the second stage's learning "
                                               "rate: it needs --pretrain-epochs (else use --lr)")
    assert load_served(lengths).censored > 0
    assert main(["--data", str(prompts), *tok, "--served-lengths", str(lengths), "--max-tokens", "1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "ran to their cap of 256 tokens (censored)" in err and "--max-tokens 256" in err
    assert "must be 0 or more" in _fail_line(capsys, ["--data", str(prompts), "--rank-loss-weight", "-1"])
    assert "invalid choice" in _fail_line(capsys, ["--data", str(prompts), "--label", "hard"])
    assert "must be 0 or more" in _fail_line(capsys, ["--data", str(prompts), "--pretrain-epochs", "-1"])
    assert "not a whole number" in _fail_line(capsys, ["--data", str(prompts), "--pretrain-samples", "many"])
    assert "must be 0 or more" in _fail_line(capsys, ["--data", str(prompts), "--aux-weight", "-0.5"])
    assert "must be above 0" in _fail_line(capsys, ["--data", str(prompts), "--finetune-lr", "0"])
    assert main(["--data", str(prompts), *tok, "--aux-weight", "1"]) == 2
    assert capsys.readouterr().err.strip() == ("train-predictor: error: --aux-weight needs --served-lengths: without "
                                               "them the data's answers are the labels already")
    assert main(["--data", str(prompts), *tok, "--served-lengths", str(lengths), "--max-tokens", "256",
                 "--aux-weight", "1", "--pretrain-epochs", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "choose one" in err


def test_pre_training_takes_the_datas_own_answers_of_training_conversations_only(served_set, data):
    """The first stage learns from the data's answers, counted by the target's tokenizer, of every conversation in the
    training split and no other: no validation or test prompt is seen by either stage."""
    from training.pipeline import prepare
    from training.split import split_of

    prompts, lengths = served_set
    cfg = TrainConfig(data=str(prompts), served_lengths=str(lengths), tokenizer=str(need_data("tokenizers/gpt2/tokenizer.json")),
                      max_tokens=256, bucket_width=64, pretrain_epochs=1, pretrain_samples=None)
    prep = prepare(cfg)
    every = [e for e in load_examples(prompts, "sharegpt") if e.response]
    train = [e for e in every if split_of(e.group, seed=0) == "train"]
    assert len(prep.pretrain) == len(train) < len(every)  # all of training's turns, none of the others
    assert {e.group for e in prep.pretrain} == {e.group for e in train}
    assert not {e.group for e in prep.pretrain} & {e.group for e in prep.splits.val + prep.splits.test}
    assert all(e.response_tokens > 0 and not e.censored for e in prep.pretrain)  # the answers' own lengths, not the cap
    assert len(prepare(cfg.model_copy(update={"pretrain_samples": 50})).pretrain) <= 50


@pytest.mark.timeout(900)
def test_soft_labels_with_the_ranking_term_train_score_per_slice_and_record_the_target(served_set, data, home, tmp_path):
    """One small real run, pre-trained on the data's own answers first: every slice scored for the model and each
    baseline, a recommendation per slice, the test rows one per sample, and the served model recorded as the target
    in the package and the registry, beside both stages' data."""
    from registry import store

    prompts, lengths = served_set
    out = tmp_path / "metrics.json"
    rc = main(["--data", str(prompts), "--served-lengths", str(lengths), "--label", "soft", "--rank-loss-weight", "0.5",
               "--tokenizer", str(need_data("tokenizers/gpt2/tokenizer.json")), "--max-tokens", "256", "--bucket-width", "64",
               "--max-samples", "300", "--epochs", "1", "--max-prompt-tokens", "24", "--experiment", "tests-served",
               "--pretrain-epochs", "1", "--pretrain-samples", "120", "--finetune-lr", "5e-4",
               "--register", "served-predictor", "--work-dir", str(tmp_path / "work"), "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    pre = r["pretrain"]
    assert pre["labels"] == "dataset answers (sharegpt)" and 0 < pre["examples"] <= 120 and 0 <= pre["best_val_acc"] <= 1
    assert set(r["slices"]) == {"first_turn", "later_turns", "all"} == set(r["recommended"])
    for block in r["slices"].values():
        assert set(block) == {"lengthwise", "global-median", "prompt-length-bin", "tfidf-logreg"}
        assert all({"accuracy", "accuracy_within_1", "mae_tokens", "kendall_tau", "pairwise_accuracy"} <= set(m)
                   for m in block.values())
    assert r["slices"]["all"]["lengthwise"] == {k: v for k, v in r["model"].items() if k in r["slices"]["all"]["lengthwise"]}
    n = r["slices"]["first_turn"]["lengthwise"]["n"] + r["slices"]["later_turns"]["lengthwise"]["n"]
    assert n == r["n_test"] == r["model"]["n"]
    assert r["recommended_by"] == "pairwise_accuracy"
    assert r["baseline_fits"]["tfidf-logreg"]["later_turns"]["fitted_on"] == "slice"
    # soft: each training prompt once, half the sample rows (two samples each); the test keeps every sample
    # (the sample cap may cut the last prompt's second sample off)
    assert r["labels"]["label"] == "soft" and r["labels"]["train_examples"] == -(-r["n_train"] // 2)
    want = load_served(lengths).target()
    assert r["labels"]["target"] == want
    agree = r["labels"]["between_samples"]["all"]  # the served model's own noise, over every prompt with two samples
    assert set(r["labels"]["between_samples"]) == {"all", "first_turn", "later_turns"}
    assert agree["prompts"] >= 10 and -1 <= agree["kendall_tau"] <= agree["ideal_tau_estimate"] <= 1
    meta = json.loads((tmp_path / "work" / "package" / "meta.json").read_text())
    assert meta["target"] == want
    assert [s["labels"] for s in meta["stages"]] == ["dataset answers (sharegpt)", MODEL]
    assert [s["examples"] for s in meta["stages"]] == [pre["examples"], r["n_train"]]
    assert [s["lr"] for s in meta["stages"]] == [2e-3, 5e-4]  # the second stage at its own learning rate
    assert store.version_target("served-predictor", r["registered_version"])["model"] == MODEL
    tags = store.MlflowClient().get_model_version("served-predictor", r["registered_version"]).tags
    assert tags[store.TAG_STAGES] == f"dataset answers (sharegpt) x {pre['examples']} > {MODEL} x {r['n_train']}"
    from mlflow import MlflowClient

    run = MlflowClient().get_run(r["run_id"])
    assert run.data.params["label"] == "soft" and float(run.data.params["rank_loss_weight"]) == 0.5
    assert {f"recommended_{s}" for s in r["recommended"]} <= set(run.data.tags)
    assert "train_rank_loss" in run.data.metrics and "later_turns_tfidf-logreg_pairwise_accuracy" in run.data.metrics
    assert "pretrain-val_acc" in run.data.metrics and int(run.data.params["n_pretrain"]) == pre["examples"]


@pytest.mark.unit
def test_a_second_head_learns_its_own_labels_and_leaves_the_served_output_alone():
    """A two-headed step trains the shared encoder through both heads; the served logits are what forward (and so the
    exported graph) gives, whatever the second head learnt."""
    from transformers import BertConfig, BertModel

    from predictor.model import LengthClassifier
    from training.module import LengthModule

    torch.manual_seed(0)
    backbone = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                    intermediate_size=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model = LengthClassifier(backbone, 16, 4, "mean", dropout=0.0, aux_buckets=4)
    module = LengthModule(model, [10.0, 30.0, 50.0, 70.0], aux_weight=0.5)
    x, m = torch.randint(1, 50, (3, 5)), torch.ones(3, 5, dtype=torch.long)
    batch = (x, m, torch.tensor([0, 1, 3]), torch.tensor([5.0, 25.0, 65.0]))
    module.log = lambda *a, **k: None  # no trainer attached
    before = model(x, m).detach()
    module.training_step({"served": batch, "answers": (x, m, torch.tensor([3, 3, 3]), torch.zeros(3))}, 0).backward()
    assert model.aux_head.weight.grad.abs().sum() > 0 and model.head.weight.grad.abs().sum() > 0
    assert next(backbone.parameters()).grad is not None
    assert torch.equal(model(x, m).detach(), before)  # forward is the served head alone (no step taken)
    assert not torch.equal(model.aux_logits(x, m), model(x, m))
    with pytest.raises(ValueError, match="no auxiliary head"):
        LengthClassifier(backbone, 16, 4, "mean").aux_logits(x, m)


@pytest.mark.timeout(600)
def test_a_two_headed_run_trains_on_the_datas_answers_beside_the_served_labels(served_set, data, home, tmp_path):
    """--aux-weight: one stage, the data's answers of training conversations on a second head; the exported package
    serves the first head (ONNX parity), and the package and the registry say what each head learnt from."""
    from mlflow import MlflowClient

    from registry import store

    prompts, lengths = served_set
    out = tmp_path / "metrics.json"
    rc = main(["--data", str(prompts), "--served-lengths", str(lengths), "--label", "soft", "--aux-weight", "0.5",
               "--pretrain-samples", "80", "--tokenizer", str(need_data("tokenizers/gpt2/tokenizer.json")), "--max-tokens",
               "256", "--bucket-width", "64", "--max-samples", "160", "--epochs", "1", "--max-prompt-tokens", "16",
               "--experiment", "tests-served", "--no-baselines", "--register", "two-headed", "--work-dir",
               str(tmp_path / "work"), "--output-json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    aux = r["auxiliary"]
    assert aux["labels"] == "dataset answers (sharegpt)" and 0 < aux["examples"] <= 80 and aux["weight"] == 0.5
    assert r["pretrain"] is None and r["onnx_parity_max_abs_diff"] < 1e-3
    meta = json.loads((tmp_path / "work" / "package" / "meta.json").read_text())
    assert [s["labels"] for s in meta["stages"]] == [MODEL] and meta["stages"][0]["auxiliary"] == {
        "labels": aux["labels"], "data": str(prompts), "examples": aux["examples"], "weight": 0.5}
    tags = MlflowClient().get_model_version("two-headed", r["registered_version"]).tags
    assert tags[store.TAG_STAGES] == (f"{MODEL} x {r['n_train']} + dataset answers (sharegpt) x {aux['examples']} on a "
                                      "second head (weight 0.5)")
    run = MlflowClient().get_run(r["run_id"])
    assert "train_aux_loss" in run.data.metrics and float(run.data.params["aux_weight"]) == 0.5


@pytest.mark.unit
def test_the_second_heads_batches_keep_pace_with_the_served_epoch_and_cycle_through_every_example():
    from training.module import CycledBatches, LengthGroupedBatches

    cycled = CycledBatches(LengthGroupedBatches([3] * 10, batch_size=4, shuffle=True, seed=0), n=2)
    epochs = [list(cycled) for _ in range(3)]
    assert [len(e) for e in epochs] == [2, 2, 2] and len(cycled) == 2
    first_pass = sorted(i for b in epochs[0] + epochs[1][:1] for i in b)
    assert first_pass == list(range(10))  # three batches (4 + 4 + 2) make one whole pass before any repeats
