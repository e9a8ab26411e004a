"""``lengthwise relabel``: seeds, prompt identity, resuming an append-only file, censored labels, bad input, and the
dataset it writes read back by train-predictor (as a jsonl dataset, or joined to the prompt set by hash)."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
from pathlib import Path

import pytest

from serving.cli import main
from serving.relabel.run import Prompt, Settings, in_shard, load_prompts, model_id, pending, record, resume, sample_seed, shard_of
from tests.datafiles import need_data
from training.data import DataError, Turn, load_examples
from training.data.served import join_served_lengths, prompt_hash, read_served

SETTINGS = Settings("m@0123456789ab", {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}, 16, 0, True)


def _conv(i: int, turns: int = 1) -> dict:
    msgs = []
    for t in range(turns):
        msgs += [{"from": "human", "value": f"question {i}.{t}"}, {"from": "gpt", "value": "an answer " * (i + 1)}]
    return {"id": f"c{i}", "conversations": msgs}


def _sharegpt(path: Path, n: int, turns: int = 1) -> Path:
    path.write_text(json.dumps([_conv(i, turns) for i in range(n)]))
    return path


def _prompt(i: int, turn: int = 0) -> Prompt:
    turns = (Turn("user", f"question {i}"),)
    return Prompt(prompt_hash(turns), f"c{i}", turn, turns)


def _write(path: Path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


@pytest.mark.unit
def test_sample_seeds_are_stable_distinct_and_32_bit():
    hashes = [prompt_hash((Turn("user", f"q{i}"),)) for i in range(300)]
    seeds = [sample_seed(0, h, s) for h in hashes for s in range(3)]
    assert seeds == [sample_seed(0, h, s) for h in hashes for s in range(3)]  # a label regenerates from its seed
    assert len(set(seeds)) == 900 and all(0 <= x < 2**32 for x in seeds)
    assert sample_seed(1, hashes[0], 0) != sample_seed(0, hashes[0], 0)
    assert sample_seed(0, "ab", 0) == 1166026131  # pinned: the derivation must not change under existing files


@pytest.mark.unit
def test_a_prompt_is_named_by_its_turns_alone():
    a = (Turn("user", "hi"), Turn("assistant", "hello"), Turn("user", "more"))
    assert prompt_hash(a) == prompt_hash(tuple(Turn(t.role, t.text) for t in a))
    assert prompt_hash(a) != prompt_hash(a[2:]) and prompt_hash(a) != prompt_hash((*a[:2], Turn("user", "more ")))
    assert prompt_hash((Turn("user", "x"),)) != prompt_hash((Turn("system", "x"),))


@pytest.mark.unit
def test_prompts_are_deduplicated_filtered_and_capped(tmp_path):
    data = tmp_path / "d.json"
    convs = [_conv(0, 2), _conv(1), _conv(0, 1) | {"id": "dup"}, _conv(2)]  # "dup" repeats c0's first turn
    data.write_text(json.dumps(convs))
    every = load_prompts(str(data), "sharegpt")
    assert [(p.group, p.turn) for p in every] == [("c0", 0), ("c0", 1), ("c1", 0), ("c2", 0)]
    assert [p.group for p in load_prompts(str(data), "sharegpt", first_turns_only=True)] == ["c0", "c1", "c2"]
    assert len(load_prompts(str(data), "sharegpt", max_prompts=2)) == 2


@pytest.mark.unit
def test_shards_split_a_prompt_set_without_overlap():
    prompts = [_prompt(i) for i in range(60)]
    parts = [in_shard(prompts, shard_of(f"{k}/3")) for k in range(3)]
    assert sorted(p.hash for part in parts for p in part) == sorted(p.hash for p in prompts)
    assert all(parts) and in_shard(prompts, shard_of(None)) == prompts
    for bad in ("2", "3/3", "-1/2", "a/b"):
        with pytest.raises(ValueError, match="--shard"):
            shard_of(bad)


@pytest.mark.unit
def test_model_id_changes_with_config_tokenizer_template_or_dummy_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    base = model_id(tmp_path, "m")
    assert base.startswith("m@") and len(base) == 14 and model_id(tmp_path, "m") == base
    assert model_id(tmp_path, "m", "dummy") != base
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    assert model_id(tmp_path, "m") != base


@pytest.mark.unit
def test_censored_is_a_sample_that_ran_to_the_cap():
    p = _prompt(1)
    capped = record(p, 0, 7, 12, 16, "length", SETTINGS)
    ended = record(p, 1, 8, 12, 5, "stop", SETTINGS)
    assert capped["censored"] and not ended["censored"]
    assert (capped["response_tokens"], capped["finish_reason"], ended["response_tokens"]) == (16, "length", 5)
    assert capped["messages"] == [{"role": "user", "content": "question 1"}] and capped["first_turn"]
    no_text = Settings(**{**SETTINGS.__dict__, "text": False})
    assert "messages" not in record(p, 0, 7, 12, 16, "length", no_text)


@pytest.mark.unit
def test_resume_skips_done_samples_and_cuts_a_torn_last_line(tmp_path):
    prompts = [_prompt(i) for i in range(3)]
    done = [record(p, s, sample_seed(0, p.hash, s), 10, 4, "stop", SETTINGS) for p in prompts[:2] for s in range(2)]
    out = tmp_path / "out.jsonl"
    _write(out, done[:3])
    complete = out.stat().st_size
    with open(out, "a") as f:
        f.write(json.dumps(done[3])[:40])  # a kill mid-line
    got = resume(out, SETTINGS)
    assert got == done[:3] and out.stat().st_size == complete  # the fragment is gone; the next line starts clean
    todo = pending(prompts, got, 2)
    assert [(p.hash, s) for p, s in todo] == [(prompts[1].hash, [1]), (prompts[2].hash, [0, 1])]
    assert pending(prompts, done + [record(prompts[2], s, 0, 1, 1, "stop", SETTINGS) for s in (0, 1)], 2) == []
    assert pending(prompts[:1], done, 3) == [(prompts[0], [2])]  # more samples later: only the new index runs
    assert resume(tmp_path / "new.jsonl", SETTINGS) == []


@pytest.mark.unit
def test_resume_refuses_a_file_of_other_settings(tmp_path):
    p = _prompt(0)
    out = tmp_path / "out.jsonl"
    _write(out, [record(p, 0, sample_seed(0, p.hash, 0), 10, 4, "stop", SETTINGS)])
    for other in ({"model": "n@0"}, {"max_tokens": 32}, {"text": False}, {"sampling": {**SETTINGS.sampling, "top_p": 1.0}}):
        with pytest.raises(ValueError, match="other settings"):
            resume(out, Settings(**{**SETTINGS.__dict__, **other}))
    with pytest.raises(ValueError, match="another --seed"):
        resume(out, Settings(**{**SETTINGS.__dict__, "seed": 1}))


@pytest.mark.unit
def test_read_served_refuses_what_relabel_did_not_write(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_hash": "a", "sample": 0, "response_tokens": 1}\nnot json\n')
    with pytest.raises(DataError, match=":2 is not a JSON line"):
        read_served(bad)
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(DataError, match="not a served-length file"):
        read_served(bad)


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """Enough of a model directory to pass the checks that come before the engine."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


@pytest.mark.unit
@pytest.mark.parametrize("extra,needle", [
    (["--samples", "0"], "--samples must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--temperature", "-0.5"], "--temperature must be above 0"),
    (["--model", "/no/such/model"], "no such file"),
    (["--data", "EMPTY"], "no usable"),
    (["--out", "NOTJSONL"], "not a JSON line"),
    (["--out", "DIR"], "cannot read"),
    (["--out", "o.jsonl.xz"], "plain JSONL"),
    (["--lora", "/nowhere"], "/nowhere is not a LoRA adapter directory"),
    (["--lora", "DIR", "--export-jobs", "j.jsonl.gz"], "--lora runs on vLLM's engine here only"),
])
def test_bad_input_exits_2_with_one_line(extra, needle, tmp_path, model_dir, capsys):
    data = _sharegpt(tmp_path / "d.json", 3)
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "notjsonl.txt").write_text("model,length\nx,3\n")
    subs = {"EMPTY": str(tmp_path / "empty.json"), "NOTJSONL": str(tmp_path / "notjsonl.txt"), "DIR": str(tmp_path)}
    if "--lora" in extra:  # an adapter that is one: the other error is the one to see
        subs["DIR"] = str(_adapter(tmp_path / "adapter"))
    argv = ["relabel", "--model", str(model_dir), "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
            *[subs.get(x, x) for x in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err


@pytest.mark.unit
def test_an_empty_prompt_set_after_the_filters_exits_2(tmp_path, model_dir, capsys):
    data = tmp_path / "multi.jsonl"  # only second turns: nothing is a first turn
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                             {"role": "user", "content": "c"}], "response_tokens": 3}) + "\n")
    assert main(["relabel", "--model", str(model_dir), "--data", str(data), "--format", "jsonl", "--first-turns-only",
                 "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "no prompts to relabel" in capsys.readouterr().err


@pytest.mark.unit
def test_a_finished_file_gets_its_summary_and_starts_no_engine(tmp_path, model_dir, capsys):
    data = _sharegpt(tmp_path / "d.json", 3)
    out = tmp_path / "o.jsonl"
    settings = Settings(model_id(model_dir, "model"), SETTINGS.sampling, 16, 0, True)
    prompts = load_prompts(str(data), "sharegpt")
    recs = [record(p, s, sample_seed(0, p.hash, s), 9, 16 if s else 4, "length" if s else "stop", settings)
            for p in prompts for s in range(2)]
    _write(out, recs)
    before = out.read_bytes()
    assert main(["relabel", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--max-tokens", "16"]) == 0
    assert out.read_bytes() == before
    summary = json.loads((tmp_path / "o.jsonl.summary.json").read_text())
    assert summary["labels"] == {"prompts": 3, "samples": 6, "capped": 3, "capped_share": 0.5, "mean": 10.0,
                                 "median": 10.0, "p90": 16.0}
    assert summary["run"]["new_samples"] == 0 and summary["sampling"] == SETTINGS.sampling
    assert summary["command"].startswith("lengthwise relabel --model ") and "--max-tokens 16" in summary["command"]
    assert "3 prompts, 6 samples" in capsys.readouterr().out


@pytest.mark.unit
def test_split_test_labels_exactly_the_prompts_train_predictor_holds_out(tmp_path, model_dir, capsys):
    """More samples of the held-out prompts (to measure how well any predictor could rank them) must be of the prompts
    train-predictor tests on: the same conversations, by the same seeded split."""
    from training.split import split_by_group

    data = _sharegpt(tmp_path / "d.json", 80, turns=2)
    held_out = {e.group for e in split_by_group(load_examples(str(data), "sharegpt")).test}
    assert 0 < len(held_out) < 40
    prompts = [p for p in load_prompts(str(data), "sharegpt") if p.group in held_out]
    out = tmp_path / "o.jsonl"
    settings = Settings(model_id(model_dir, "model"), SETTINGS.sampling, 16, 0, True)
    _write(out, [record(p, s, sample_seed(0, p.hash, s), 9, 5, "stop", settings) for p in prompts for s in range(2)])
    argv = ["relabel", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--max-tokens", "16"]
    assert main([*argv, "--split", "test"]) == 0  # every held-out prompt is labelled: nothing to run
    assert f"{len(prompts)} prompts, {2 * len(prompts)} samples" in capsys.readouterr().out
    assert len(prompts) == 2 * len(held_out)  # both turns of each held-out conversation
    assert "--split test --split-seed 0" in json.loads((tmp_path / "o.jsonl.summary.json").read_text())["command"]


def _adapter(d: Path, weights: bytes = b"w" * 64) -> Path:
    d.mkdir(parents=True)
    (d / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "peft_type": "LORA"}))
    (d / "adapter_model.safetensors").write_bytes(weights)
    return d


@pytest.mark.unit
def test_an_adapters_labels_name_the_adapter_on_its_base(tmp_path, model_dir, capsys):
    """``--lora``: the labels are the adapter's, not the base's; the identity changes with the adapter's weights and
    with the base, so a predictor trained on one adapter's lengths is not taken for another's."""
    from predictor.target import adapter_id

    terse = _adapter(tmp_path / "terse")
    base = model_id(model_dir, "model")
    ident = adapter_id(base, terse, "terse")
    assert ident.startswith("terse@") and ident == adapter_id(base, terse, "terse")
    assert ident != adapter_id(base, _adapter(tmp_path / "b" / "terse", b"v" * 64), "terse")  # retrained
    assert ident != adapter_id("other@0123456789ab", terse, "terse")  # the same adapter on another base
    data = _sharegpt(tmp_path / "d.json", 2)
    out = tmp_path / "o.jsonl"
    settings = Settings(ident, SETTINGS.sampling, 16, 0, True)
    _write(out, [record(p, s, sample_seed(0, p.hash, s), 9, 5, "stop", settings)
                 for p in load_prompts(str(data), "sharegpt") for s in range(2)])
    argv = ["relabel", "--model", str(model_dir), "--data", str(data), "--out", str(out), "--max-tokens", "16"]
    assert main([*argv, "--lora", str(terse)]) == 0  # all there: the adapter's file, no engine started
    assert json.loads((tmp_path / "o.jsonl.summary.json").read_text())["model"] == ident
    capsys.readouterr()
    assert main(argv) == 2  # the base's run refuses the adapter's file
    assert "holds labels of other settings (model terse@" in capsys.readouterr().err


def _relabelled(prompts: list[Prompt], out: Path, text: bool) -> list[dict]:
    """What relabel writes for ``prompts``, 2 samples each with made-up lengths (a 16-token cap)."""
    settings = Settings(**{**SETTINGS.__dict__, "text": text})
    recs = [record(p, s, sample_seed(0, p.hash, s), 9, 3 + (7 * i + 5 * s) % 14, "stop", settings)
            for i, p in enumerate(prompts) for s in range(2)]
    _write(out, recs)
    return recs


@pytest.mark.unit
def test_the_written_file_is_a_jsonl_dataset_with_the_served_lengths_as_labels(tmp_path):
    multi = (Turn("user", "q"), Turn("assistant", "a"), Turn("user", "follow-up"))
    prompts = [_prompt(0), Prompt(prompt_hash(multi), "c9", 1, multi)]
    recs = _relabelled(prompts, tmp_path / "out.jsonl", text=True)
    ex = load_examples(tmp_path / "out.jsonl", "jsonl")
    assert [e.response_tokens for e in ex] == [r["response_tokens"] for r in recs]  # the label, not a recount
    assert [e.group for e in ex] == ["c0", "c0", "c9", "c9"]
    assert ex[2].turns == multi and prompt_hash(ex[2].turns) == recs[2]["prompt_hash"]


def test_train_predictor_reads_both_outputs_with_the_served_lengths(tmp_path, data):
    """Through train-predictor's own data step: the jsonl dataset, and --served-lengths joined to the prompt set."""
    from training.config import TrainConfig
    from training.pipeline import prepare

    sharegpt = _sharegpt(tmp_path / "set.json", 40)
    prompts = load_prompts(str(sharegpt), "sharegpt")
    want = {(r["group"], r["response_tokens"]) for r in _relabelled(prompts, tmp_path / "text.jsonl", text=True)}
    _relabelled(prompts, tmp_path / "lengths.jsonl", text=False)
    tok = str(need_data("tokenizers/gpt2/tokenizer.json"))
    for cfg in (TrainConfig(data=str(tmp_path / "text.jsonl"), fmt="jsonl", tokenizer=tok),
                TrainConfig(data=str(sharegpt), fmt="sharegpt", tokenizer=tok, served_lengths=str(tmp_path / "lengths.jsonl"))):
        s = prepare(cfg).splits
        got = [(e.group, e.response_tokens) for e in s.train + s.val + s.test]
        assert len(got) == 80 and set(got) == want, cfg.fmt


@pytest.mark.unit
def test_join_labels_each_prompt_once_per_sample_and_says_when_nothing_matches(tmp_path):
    sharegpt = _sharegpt(tmp_path / "set.json", 3)
    prompts = load_prompts(str(sharegpt), "sharegpt")
    recs = _relabelled(prompts[:2], tmp_path / "lengths.jsonl", text=False)
    examples = load_examples(sharegpt, "sharegpt")
    joined = join_served_lengths(examples + examples[:1], tmp_path / "lengths.jsonl")  # a repeated prompt: once
    assert [(e.group, e.response_tokens) for e in joined] == [(r["group"], r["response_tokens"]) for r in recs]
    assert all(e.response is None for e in joined)
    xz = tmp_path / "lengths.jsonl.xz"  # as it would be committed
    xz.write_bytes(lzma.compress((tmp_path / "lengths.jsonl").read_bytes()))
    assert join_served_lengths(examples, xz) == joined
    _write(tmp_path / "other.jsonl", [{**recs[0], "prompt_hash": "0" * 64}])
    with pytest.raises(DataError, match="none of the 3 prompts"):
        join_served_lengths(examples, tmp_path / "other.jsonl")


@pytest.mark.unit
def test_a_retrains_base_set_leaves_out_the_conversations_a_bench_replays(tmp_path):
    """lengthwise bench loop replays conversations of the slice as traffic: the retrain's base set (the same slice,
    relabelled) must not train on them, or the guard's held-out feedback and phase 2 would judge seen prompts."""
    import dataclasses

    from training.retrain import Settings as RetrainSettings
    from training.retrain import _base_examples

    sharegpt = _sharegpt(tmp_path / "set.json", 4, turns=2)
    _relabelled(load_prompts(str(sharegpt), "sharegpt"), tmp_path / "lengths.jsonl", text=False)
    s = RetrainSettings(base_data=str(sharegpt), base_served_lengths=str(tmp_path / "lengths.jsonl"))
    everything = _base_examples(s)
    groups = sorted({e.group for e in everything})
    assert len(groups) == 4 and len(everything) == 16  # 4 conversations x 2 turns x 2 samples
    kept = _base_examples(dataclasses.replace(s, base_exclude_groups=frozenset(groups[:2])))
    assert {e.group for e in kept} == set(groups[2:]) and len(kept) == 8


# --- the real engine: a dummy-weight model with GPT-2's tokenizer and a chat template --------------------------------
def _relabel(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.cli", "relabel", *args], capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.timeout(300)
def test_relabel_runs_the_engine_appends_nothing_twice_and_resumes(tmp_path, data):
    """Six ShareGPT first turns x 2 samples on the micro model: every line written; a second run adds nothing; a run
    killed mid-line (the file cut there) writes exactly the missing samples."""
    from serving.launch.models import dummy_model
    from training.data.loaders import load_sharegpt

    short = [e for e in load_sharegpt(need_data("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"), True)
             if len(e.turns) == 1 and len(e.latest) < 300][:6]
    prompts = tmp_path / "six.json"
    prompts.write_text(json.dumps([{"id": e.group, "conversations": [{"from": "human", "value": e.latest},
                                                                      {"from": "gpt", "value": e.response}]} for e in short]))
    model = dummy_model("micro", 512, tmp_path / "model", tokenizer_json=need_data("tokenizers/gpt2/tokenizer.json"))
    out = tmp_path / "out.jsonl"
    args = ["--model", model, "--data", str(prompts), "--out", str(out), "--samples", "2", "--max-tokens", "16",
            "--load-format", "dummy", "--kv-cache-gib", "0.25", "--chunk", "4"]

    first = _relabel(args)
    assert first.returncode == 0, first.stderr[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 12 and len({(r["prompt_hash"], r["sample"]) for r in recs}) == 12
    assert {r["group"] for r in recs} == {e.group for e in short}
    assert all(1 <= r["response_tokens"] <= 16 and r["censored"] == (r["finish_reason"] == "length") for r in recs)
    assert all(r["prompt_tokens"] > 0 and r["model"].startswith("model@") for r in recs)
    summary = json.loads((tmp_path / "out.jsonl.summary.json").read_text())
    assert summary["labels"]["samples"] == 12 and summary["run"]["new_samples"] == 12
    assert summary["run"]["output_tokens"] == sum(r["response_tokens"] for r in recs)
    assert "relabel: 6 prompts, 12 samples" in first.stdout

    before = out.read_bytes()
    again = _relabel(args)  # everything is there: no engine, nothing appended
    assert again.returncode == 0 and out.read_bytes() == before, again.stderr[-2000:]

    lines = before.split(b"\n")
    out.write_bytes(b"\n".join(lines[:7]) + b"\n" + lines[7][:25])  # 7 samples kept, the 8th torn by a kill
    resumed = _relabel(args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = [json.loads(x) for x in out.read_text().splitlines()]
    assert after[:7] == recs[:7] and len(after) == 12
    assert {(r["prompt_hash"], r["sample"], r["seed"]) for r in after} == {(r["prompt_hash"], r["sample"], r["seed"])
                                                                           for r in recs}
    assert json.loads((tmp_path / "out.jsonl.summary.json").read_text())["run"]["new_samples"] == 5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_relabel_through_a_lora_adapter_on_the_engine(tmp_path, data):
    """``--lora`` on vLLM's engine: a peft adapter of the micro model (random weights, saved) is merged into the base
    once, and every sample is drawn from the merged model under the adapter's identity; its counterpart in ``make test``
    checks that identity and the errors without an engine."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from serving.launch.models import dummy_model

    model = Path(dummy_model("micro", 512, tmp_path / "model", tokenizer_json=need_data("tokenizers/gpt2/tokenizer.json")))
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig.from_pretrained(model))
    base.save_pretrained(model)
    lora = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "terse")
    out = tmp_path / "out.jsonl"
    run = _relabel(["--model", str(model), "--lora", str(tmp_path / "terse"), "--data", str(_sharegpt(tmp_path / "d.json", 4)),
                    "--out", str(out), "--samples", "2", "--max-tokens", "8", "--kv-cache-gib", "0.25",
                    "--model-cache", str(tmp_path / "cache")])
    assert run.returncode == 0, run.stderr[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 8 and all(r["model"].startswith("terse@") and 1 <= r["response_tokens"] <= 8 for r in recs)
    assert {r["engine"] for r in recs} == {"vllm, LoRA merged into the base"}
    merged = list((tmp_path / "cache").iterdir())
    assert len(merged) == 1 and merged[0].name.startswith("model+terse-") and (merged[0] / "tokenizer.json").is_file()
