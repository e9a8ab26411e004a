"""``lengthwise relabel-ceiling``: the measured taus of K samples per prompt, the noise model they check, pooling files
of one set-up (and refusing a repeated draw or another set-up), and the command's table and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from serving.cli import main
from serving.relabel.ceiling import ceiling, model_tau, pool

pytestmark = pytest.mark.unit

SETUP = {"model": "m@0123456789ab", "sampling": {"temperature": 0.7}, "max_tokens": 512}


def _samples(n: int, k: int, rho: float, seed: int = 0) -> np.ndarray:
    """Lengths as the noise model has them: a prompt's mean plus independent noise, the mean's share of the variance rho."""
    rng = np.random.default_rng(seed)
    mean = rng.normal(0, math.sqrt(rho), (n, 1))
    return 300 + 100 * (mean + rng.normal(0, math.sqrt(1 - rho), (n, k)))


def test_the_noise_model_starts_at_the_between_sample_tau_and_rises_to_the_ceiling():
    assert model_tau(0.3, 1) == pytest.approx(0.3)
    taus = [model_tau(0.3, m) for m in (1, 2, 3, 10, math.inf)]
    assert taus == sorted(taus) and taus[-1] < 1
    assert model_tau(0.0, math.inf) == 0.0
    rho = math.sin(math.pi * 0.3 / 2)
    assert model_tau(0.3, math.inf) == pytest.approx(2 / math.pi * math.asin(math.sqrt(rho)))


def test_on_lengths_the_model_describes_the_measured_means_match_it():
    x = _samples(3000, 4, rho=0.45)
    first = np.arange(3000) % 2 == 0
    exact = x[:, :1] * 0 + x.mean(1, keepdims=True)  # stand-in predictor: the mean of all four (sees the truth)
    res = ceiling(x, first, {"oracle": exact[:, 0]}, boot=20)
    for name in ("all", "first_turn", "later_turns"):
        s = res[name]
        for m in (2, 3):
            assert s["measured"][f"mean_of_{m}"] == pytest.approx(s["noise_model"][f"mean_of_{m}"], abs=0.02)
        measured = s["measured"]
        assert measured["between"] < measured["mean_of_2"] < measured["mean_of_3"] < s["noise_model"]["prompt_mean"]
        lo, hi = s["interval95"]["between"]
        assert lo <= s["measured"]["between"] <= hi
    assert res["all"]["prompts"] == 3000 and res["first_turn"]["prompts"] == 1500
    # a predictor that is each prompt's mean of its samples ranks that mean perfectly
    assert res["all"]["measured"]["oracle_vs_mean"] == pytest.approx(1.0)


def _write(path: Path, rows: list[tuple[str, int, int, int]], setup: dict = SETUP) -> Path:
    path.write_text("".join(json.dumps({"prompt_hash": h, "sample": s, "seed": seed, "response_tokens": n,
                                        "first_turn": h.startswith("f"), **setup}) + "\n" for h, s, seed, n in rows))
    return path


def test_files_pool_per_prompt_and_a_repeated_draw_or_another_set_up_is_refused(tmp_path):
    a = _write(tmp_path / "a.jsonl", [("f1", 0, 10, 5), ("f1", 1, 11, 7), ("l2", 0, 12, 9)])
    b = _write(tmp_path / "b.jsonl", [("f1", 0, 20, 6), ("f1", 1, 21, 8)])
    lengths, first, setup = pool([a, b])
    assert lengths == {"f1": [5, 7, 6, 8], "l2": [9]} and first == {"f1": True, "l2": False} and setup == SETUP
    again = _write(tmp_path / "again.jsonl", [("f1", 0, 10, 5)])
    with pytest.raises(ValueError, match="repeats a draw"):
        pool([a, again])
    other = _write(tmp_path / "other.jsonl", [("f1", 0, 30, 5)], SETUP | {"max_tokens": 1024})
    with pytest.raises(ValueError, match="another set-up"):
        pool([a, other])


def test_the_command_prints_the_table_and_writes_the_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps nothing
    x = _samples(60, 4, rho=0.5, seed=1).round().astype(int)
    half = [(f"{'f' if i % 2 else 'l'}{i}", s, 100 * i + s, int(x[i, s])) for i in range(60) for s in range(2)]
    rest = [(f"{'f' if i % 2 else 'l'}{i}", s - 2, 100 * i + s, int(x[i, s])) for i in range(60) for s in range(2, 4)]
    files = [str(_write(tmp_path / "a.jsonl", half)), str(_write(tmp_path / "b.jsonl", rest))]
    out = tmp_path / "c.json"
    assert main(["relabel-ceiling", *files, "--bootstrap", "20", "--json", str(out)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "60 prompts x 4 samples" in text and "the mean of 3 other samples" in text and "(the ceiling)" in text
    assert "noise model: the mean of 1 other sample " in text
    res = json.loads(out.read_text())
    assert res["prompts"] == 60 and set(res["slices"]) == {"all", "first_turn", "later_turns"}
    assert main(["relabel-ceiling", files[0]]) == 2  # two samples a prompt: fewer than --samples 4
    assert "only 0 prompts have 4 samples" in capsys.readouterr().err
