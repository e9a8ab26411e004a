"""The transformers engine of ``lengthwise relabel`` (:mod:`serving.relabel.transformers_engine`): vLLM's sampling
rules, a sample's tokens a function of its seed alone, vLLM's stop semantics, and the jobs-out / results-in round trip
through the CLI."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from serving.cli import main
from serving.relabel.transformers_engine import Job, SamplingSpec, batches, generate, noise_at, sample
from serving.relabel.transformers_engine import main as relabel_torch_main
from tests.datafiles import need_data
from training.data.served import read_served


def _tiny(vocab: int = 97):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.unit
def test_the_noise_of_a_row_depends_on_its_seed_and_step_alone():
    seeds = torch.tensor([5, 6, 7], dtype=torch.int64)
    vocab = torch.arange(1000)[None, :]
    u = noise_at(seeds, 3, vocab.expand(3, -1))
    assert torch.equal(u[1], noise_at(torch.tensor([6]), 3, vocab)[0])  # not on the batch
    assert torch.equal(u[2, [7, 500]], noise_at(seeds[2:], 3, torch.tensor([[7, 500]]))[0])  # nor on the tokens asked
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], noise_at(seeds, 4, vocab.expand(3, -1))[0])
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.02


@pytest.mark.unit
def test_top_p_temperature_and_the_race_draw_vllms_distribution():
    """probs .5/.3/.15/.05 with top_p 0.9: the last token is cut (the tokens above it hold 0.95 >= 0.9), the rest are
    drawn in proportion; 4,000 seeds pass a chi-square test."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = torch.log(probs).repeat(n, 1)
    s = SamplingSpec(temperature=1.0, top_p=0.9, repetition_penalty=1.0, max_tokens=1)
    tok = sample(logits, torch.zeros_like(logits, dtype=torch.bool), torch.arange(n), 0, s)
    counts = np.bincount(tok.numpy(), minlength=4)
    assert counts[3] == 0
    expected = np.array([0.5, 0.3, 0.15]) / 0.95 * n
    assert chisquare(counts[:3], expected).pvalue > 1e-3, counts


@pytest.mark.unit
def test_the_repetition_penalty_lowers_seen_tokens_either_sign():
    logits = torch.tensor([[2.0, -1.0, 2.0, -1.0]]).repeat(3000, 1)
    seen = torch.tensor([[True, True, False, False]]).repeat(3000, 1)
    s = SamplingSpec(temperature=1.0, top_p=1.0, repetition_penalty=2.0, max_tokens=1)
    counts = np.bincount(sample(logits, seen, torch.arange(3000), 0, s).numpy(), minlength=4)
    # penalised logits 1.0 and -2.0 against 2.0 and -1.0: the unseen twin of each wins
    assert counts[2] > counts[0] > counts[3] > counts[1], counts


@pytest.mark.unit
def test_a_sample_is_the_same_alone_or_in_a_padded_batch_and_stops_as_vllm_stops():
    model = _tiny()
    stops = torch.arange(0, 97, 9)  # 11 of 97 tokens end a sample: lengths spread below the cap
    s = SamplingSpec(temperature=0.8, top_p=0.95, repetition_penalty=1.1, max_tokens=12)
    rng = np.random.default_rng(0)
    jobs = [Job(f"j{i}", 1000 + i, tuple(int(x) for x in rng.integers(1, 97, size=3 + 5 * i))) for i in range(6)]
    together: list[list[int]] = []
    out = generate(model, jobs, s, stops, 0, together)
    for i, j in enumerate(jobs):
        alone: list[list[int]] = []
        assert generate(model, [j], s, stops, 0, alone) == [out[i]]
        assert alone[0] == together[i]
    for (n, reason), toks in zip(out, together):
        assert n == len(toks) and 1 <= n <= s.max_tokens
        assert not any(t in stops.tolist() for t in toks[:-1])  # nothing after the first stop token
        assert reason == ("stop" if n < s.max_tokens else "length")
        assert (toks[-1] in stops.tolist()) or reason == "length"
    assert len({n for n, _ in out}) > 1, out  # the seeds differ, so do the lengths


@pytest.mark.unit
def test_batches_hold_their_budgets_and_every_job_once():
    jobs = [Job(str(i), i, tuple(range(1 + (i * 37) % 300))) for i in range(200)]
    bs = list(batches(jobs, 64, kv_tokens=5000, attn_elems=2e6, max_rows=32))
    assert sorted(j.key for b in bs for j in b) == sorted(j.key for j in jobs)
    for b in bs:
        longest = max(len(j.prompt_ids) for j in b)
        assert len(b) <= 32 and (len(b) == 1 or (len(b) * (longest + 64) <= 5000 and len(b) * longest**2 <= 2e6))


def test_jobs_out_results_in_gives_the_records_vllm_would_write(tmp_path, data):
    """Export the jobs, label them with the module on a random-weight model, import: one record per sample with the
    engine named, read back by train-predictor's reader; importing again adds nothing."""
    from serving.launch.models import dummy_model

    model = Path(dummy_model("micro", 512, tmp_path / "model", tokenizer_json=need_data("tokenizers/gpt2/tokenizer.json")))
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).save_pretrained(model)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"id": f"c{i}", "conversations": [{"from": "human", "value": f"question {i} " * (i + 1)},
                                                                     {"from": "gpt", "value": "an answer"}]}
                                   for i in range(4)]))
    out, jobs, res = tmp_path / "l.jsonl", tmp_path / "jobs.jsonl.gz", tmp_path / "res.jsonl"
    base = ["relabel", "--model", str(model), "--data", str(prompts), "--out", str(out), "--no-text", "--max-tokens", "6"]
    assert main([*base, "--export-jobs", str(jobs)]) == 0 and not out.exists()
    with gzip.open(jobs, "rt") as f:
        header, lines = json.loads(next(f)), [json.loads(x) for x in f]
    assert header["max_tokens"] == 6 and len(lines) == 8 and all(x["prompt_ids"] for x in lines)
    cut = [str(jobs), str(res), "--model", str(model), "--device", "cpu", "--max-rows", "2", "--stop-after", "0"]
    assert relabel_torch_main(cut) == 0  # out of time before the first batch: nothing drawn, all left for a resume
    assert json.loads(res.with_name("res.jsonl.run.json").read_text())["left"] == 8 and not res.read_text()
    assert relabel_torch_main([str(jobs), str(res), "--model", str(model), "--device", "cpu"]) == 0
    assert json.loads(res.with_name("res.jsonl.run.json").read_text())["samples"] == 8
    assert main([*base, "--import-results", str(res)]) == 0
    recs, _ = read_served(out)
    assert len(recs) == 8 and {r["sample"] for r in recs} == {0, 1}
    assert all(r["engine"].startswith("transformers") and 1 <= r["response_tokens"] <= 6 for r in recs)
    command = json.loads((tmp_path / "l.jsonl.summary.json").read_text())["command"]
    assert "--no-text" in command and "--import-results" in command  # the summary reruns what was run
    before = out.read_bytes()
    assert main([*base, "--import-results", str(res)]) == 0 and out.read_bytes() == before
    assert main([*base, "--export-jobs", str(jobs), "--import-results", str(res)]) == 2


def _written(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _records(seed: int, means: np.ndarray, model: str = "m@1", engine: str = "vllm") -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_hash": f"p{i}", "sample": k, "response_tokens": int(min(max(1, rng.normal(m, 40)), 512)),
             "model": model, "sampling": {"temperature": 0.7}, "max_tokens": 512, "engine": engine}
            for i, m in enumerate(means) for k in range(2)]


@pytest.mark.unit
def test_agreement_finds_two_draws_of_one_model_alike_and_a_shifted_one_not(tmp_path):
    from serving.relabel.agreement import agreement
    from training.data.served import load_served

    def lengths(seed: int, means: np.ndarray) -> dict[str, list[int]]:  # as the CLI reads a file
        return load_served(_written(tmp_path / f"{seed}-{len(means)}-{means[0]:.0f}.jsonl", _records(seed, means))).lengths

    means = np.random.default_rng(9).uniform(50, 450, size=300)
    same = agreement(lengths(1, means), lengths(2, means), 512)
    assert same["prompts"] == 300 and same["ks_pvalue"] > 0.01
    assert abs(same["tau_across"][0] - same["tau_within_a"]) < 0.1 and same["tau_of_means"] > 0.6
    shifted = agreement(lengths(1, means), lengths(2, means * 0.6), 512)
    assert shifted["ks_pvalue"] < 1e-6 and shifted["b"]["mean"] < shifted["a"]["mean"]
    with pytest.raises(ValueError, match="only 5 prompts"):
        agreement(lengths(1, means[:5]), lengths(2, means[:5]), 512)


@pytest.mark.unit
def test_agreement_cli_refuses_files_of_other_settings(tmp_path, capsys):
    means = np.full(20, 200.0)
    for name, model in (("a.jsonl", "m@1"), ("b.jsonl", "m@2")):
        _written(tmp_path / name, _records(0, means, model))
    assert main(["relabel-agreement", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert "different settings" in err and "\n" not in err
    assert main(["relabel-agreement", str(tmp_path / "a.jsonl"), str(tmp_path / "a.jsonl"), "--json",
                 str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["tau_across"][0] == pytest.approx(1.0)
