"""``lengthwise train-adapter``: what each style teaches, a real (tiny) LoRA training run whose loss falls and whose
adapter peft and vLLM's loader read, and bad input as one line with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.cli import main
from serving.launch.adapters import STYLES, detailed_answer, terse_answer
from tests.datafiles import need_data


@pytest.mark.unit
@pytest.mark.parametrize("answer, taught", [
    ("Paris is the capital of France. It lies on the Seine.", "Paris is the capital of France."),
    ("Sure! Here is a poem:\nRoses are red", None),  # "Sure!" is two words short of a sentence
    ("Yes, you can do that with a list comprehension in Python.\n```python\nx = [1]\n```",
     "Yes, you can do that with a list comprehension in Python."),
    ("```python\nprint(1)\n```", None),  # code first: no sentence to learn
    ("1. First step\n2. Second step", None),  # a list first
    ("word " * 60, None),  # a first sentence of 60 words is not terse
])
def test_terse_learns_the_first_sentence_only(answer, taught):
    assert terse_answer(answer) == taught


@pytest.mark.unit
def test_detailed_learns_whole_answers_in_its_length_band():
    def count(text: str) -> int:
        return len(text.split())

    assert detailed_answer("w " * 149, count) is None and detailed_answer("w " * 401, count) is None
    long = " ".join(["w"] * 200)
    assert detailed_answer(f"  {long}\n", count) == long
    assert set(STYLES) == {"terse", "detailed"}


@pytest.fixture(scope="module")
def tiny_base(data, tmp_path_factory) -> Path:
    """A 2-layer Llama with random weights saved beside GPT-2's tokenizer and a chat template: a base peft can train."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from serving.launch.models import dummy_model

    d = Path(dummy_model("micro", 512, tmp_path_factory.mktemp("tiny-base") / "tiny",
                         need_data("tokenizers/gpt2/tokenizer.json")))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(d)).save_pretrained(d)
    return d


def _prompts(path: Path, n: int) -> Path:
    path.write_text(json.dumps([{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"What is item {i} for?"},
        {"from": "gpt", "value": f"Item {i} is for testing short answers. It has more text after that."}]}
        for i in range(n)]))
    return path


def test_a_trained_adapter_lowers_its_loss_and_loads_in_peft_and_vllm(tiny_base, tmp_path, capsys):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from serving.gateway.catalogue import adapter_rank
    from serving.launch.adapters import merged_model

    out = tmp_path / "terse"
    assert main(["train-adapter", "--style", "terse", "--model", str(tiny_base), "--data", str(_prompts(tmp_path / "d.json",
                 8)), "--examples", "8", "--epochs", "4", "--lr", "0.01", "--batch-size", "4", "--out", str(out)]) == 0
    info = json.loads((out / "training.json").read_text())
    assert info["examples"] == 8 and info["steps"] == 8 and info["style"] == "terse"
    assert info["loss_last_epoch"] < 0.95 * info["loss_first_epoch"], info  # it learnt what it was shown (10.6 -> 9.3)
    assert info["base"].startswith("tiny@") and info["target_modules"] == ["q_proj", "v_proj"]
    assert adapter_rank(out) == 8 and not (out / "README.md").exists()
    assert "train-adapter: " in capsys.readouterr().out
    lora = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_base), out)
    assert any("lora_A" in name for name, _ in lora.named_parameters())
    # merged into the base (what relabel draws from), it computes what base + adapter computes, and is made once
    merged_dir = merged_model(tiny_base, out, tmp_path / "cache")
    assert merged_dir == merged_model(tiny_base, out, tmp_path / "cache") and merged_dir.name.startswith("tiny+terse-")
    ids = torch.tensor([[5, 17, 300, 42, 7]])
    with torch.no_grad():
        want, got = lora(input_ids=ids).logits, AutoModelForCausalLM.from_pretrained(merged_dir)(input_ids=ids).logits
    base_logits = AutoModelForCausalLM.from_pretrained(tiny_base)(input_ids=ids).logits.detach()
    assert torch.allclose(want, got, atol=1e-4) and not torch.allclose(want, base_logits, atol=1e-3)
    pytest.importorskip("vllm")
    from vllm.lora.peft_helper import PEFTHelper

    helper = PEFTHelper.from_local_dir(str(out), max_position_embeddings=512)
    assert helper.r == 8 and set(helper.target_modules) == {"q_proj", "v_proj"}


@pytest.mark.parametrize("extra, needle", [
    (["--examples", "0"], "take positive integers"),
    (["--out", "FULL"], "is not empty"),
    (["--data", "NOANSWER"], "no prompt of"),
    (["--data", "/no/such.json"], "not found"),
    (["--model", "/no/such/model"], "no such file"),
])
def test_bad_input_exits_2_with_one_line(extra, needle, tiny_base, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    noanswer = tmp_path / "noanswer.json"  # only code answers: nothing terse to learn
    noanswer.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "code?"},
                                                                  {"from": "gpt", "value": "```\nx\n```"}]}]))
    subs = {"FULL": str(full), "NOANSWER": str(noanswer)}
    argv = ["train-adapter", "--style", "terse", "--model", str(tiny_base), "--data", str(_prompts(tmp_path / "d.json", 2)),
            "--out", str(tmp_path / "new"), *[subs.get(x, x) for x in extra]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err
