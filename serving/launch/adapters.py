"""``lengthwise train-adapter``: a LoRA adapter of the served model, trained to answer shorter or longer than its base.

Why: the commonest way a fleet serves several models is many fine-tunes of one base, each a LoRA adapter that vLLM
serves beside the base in one batch and one KV pool (``--lora-modules``). What makes such services hard to schedule
together is that they answer at different lengths for the same prompt: a scheduler that knows only the base's lengths
orders them by the wrong numbers, and SeaLLM's per-service profile knows only each service's mean. The adapters made
here are real fine-tunes of SmolLM2 whose lengths differ by training, so the several-services path (the catalogue,
per-model predictions, the policies' per-service terms) runs on models that truly differ, on this CPU:

- ``terse``: taught ChatGPT's first sentence of each ShareGPT answer (at most 40 words), then the end of the turn;
- ``detailed``: taught ChatGPT's whole answers of 150 to 400 of the base's tokens, to their end.

The base model itself is the third service. What each one really answers is measured, not assumed: relabel it
(``lengthwise relabel --lora DIR``) and train on those lengths.

Training is peft's LoRA on the attention's query and value projections, on the chat-templated prompt and answer, with
the loss on the answer's tokens only (the end-of-turn token among them: that is what moves the length). A few minutes
on 2 CPU cores; the adapter directory is what vLLM's ``--lora-modules`` and peft load, with ``training.json`` beside it
(the command, the data, the loss before and after, the time).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.launch.models import DEFAULT_MODEL_CACHE
from serving.progress import logged

LORA_RANK = 8  # the adapters' rank on the query and value projections: the committed ones, the benches' random ones
TERSE_MAX_WORDS = 40
DETAILED_TOKENS = (150, 400)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s|\n")


@dataclass(frozen=True)
class Style:
    """How an adapter is taught to answer: the answer it learns for a ChatGPT answer (None: the example is skipped)."""

    name: str
    describe: str
    target: Callable[[str, Callable[[str], int]], str | None]  # (ChatGPT's answer, a token counter) -> what to learn


def terse_answer(answer: str, _count: Callable[[str], int] | None = None) -> str | None:
    """The answer's first sentence, when it is a sentence of 3 to 40 words (a list or code opening is skipped)."""
    first = _SENTENCE_END.split(answer.strip(), maxsplit=1)[0].strip()
    words = len(first.split())
    if not 3 <= words <= TERSE_MAX_WORDS or first.startswith(("```", "|", "-", "*", "#", "1.")):
        return None
    return first


def detailed_answer(answer: str, count: Callable[[str], int]) -> str | None:
    """The whole answer, when it runs 150 to 400 of the base's tokens: long answers that end."""
    text = answer.strip()
    return text if DETAILED_TOKENS[0] <= count(text) <= DETAILED_TOKENS[1] else None


STYLES = {s.name: s for s in (
    Style("terse", f"ChatGPT's first sentence (3 to {TERSE_MAX_WORDS} words), then the end of the turn", terse_answer),
    Style("detailed", f"ChatGPT's whole answers of {DETAILED_TOKENS[0]} to {DETAILED_TOKENS[1]} tokens", detailed_answer),
)}


@dataclass(frozen=True)
class Pair:
    """One training example: the prompt's and the answer's token ids, the answer's ending with the end of the turn."""

    prompt: list[int]
    answer: list[int]


def training_pairs(model_dir: Path, data: str, style: Style, n: int, max_prompt_tokens: int, seed: int) -> list[Pair]:
    """``n`` ShareGPT first turns whose ChatGPT answer ``style`` keeps, each rendered in the model's chat template: the
    prompt with the generation prompt, the answer as the template closes an assistant turn (its end-of-turn token)."""
    from transformers import AutoTokenizer

    from training.data.loaders import load_sharegpt

    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = [e for e in load_sharegpt(data, first_turn_only=True) if e.response]
    random.Random(seed).shuffle(examples)

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    out: list[Pair] = []
    for e in examples:
        target = style.target(e.response, count)
        if target is None:
            continue
        msgs = [{"role": t.role, "content": t.text} for t in e.turns]
        prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template([*msgs, {"role": "assistant", "content": target}], tokenize=False)
        if not full.startswith(prompt):
            raise ValueError(f"{model_dir}'s chat template does not render an answer after its generation prompt")
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        if len(p_ids) > max_prompt_tokens:
            continue
        out.append(Pair(p_ids, tok(full[len(prompt):].rstrip("\n"), add_special_tokens=False)["input_ids"]))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"no prompt of {data} gives a '{style.name}' answer within {max_prompt_tokens} prompt tokens")
    return out


def _batches(pairs: list[Pair], size: int, rng: random.Random) -> list[list[Pair]]:
    """Batches of similar lengths (little padding), in a shuffled order."""
    ordered = sorted(pairs, key=lambda p: len(p.prompt) + len(p.answer))
    batches = [ordered[i:i + size] for i in range(0, len(ordered), size)]
    rng.shuffle(batches)
    return batches


def _tensors(batch: list[Pair], pad: int) -> dict[str, Any]:
    """Right-padded ids, the attention mask, and labels that score the answer's tokens only."""
    import torch

    width = max(len(p.prompt) + len(p.answer) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, p in enumerate(batch):
        seq = p.prompt + p.answer
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, len(p.prompt):len(seq)] = torch.tensor(p.answer)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def train_adapter(model_dir: Path, pairs: list[Pair], out: Path, rank: int = LORA_RANK, alpha: int = 16, epochs: int = 2,
                  lr: float = 5e-4, batch_size: int = 8, seed: int = 0) -> dict[str, Any]:
    """Train a LoRA adapter on ``pairs`` and save it in ``out`` (peft's format, which vLLM loads); the run's losses
    and time. The loss is the answer tokens' mean cross-entropy, per step; its first and last epochs are reported."""
    import torch
    from peft import LoraConfig, get_peft_model
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.05, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "v_proj"]))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=lr)
    plan = [_batches(pairs, batch_size, rng) for _ in range(epochs)]
    losses: list[list[float]] = [[] for _ in range(epochs)]
    t0 = time.monotonic()
    lora.train()
    with Progress(TextColumn(f"[bold]train-adapter[/] {out.name}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn()) as bar, \
            logged(bar, "train-adapter"):
        task = bar.add_task("", total=sum(map(len, plan)), loss="-")
        for epoch, batches in enumerate(plan):
            for batch in batches:
                loss = lora(**_tensors(batch, pad)).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[epoch].append(loss.item())
                bar.update(task, advance=1, loss=f"{loss.item():.3f}")
    lora.save_pretrained(out)
    (out / "README.md").unlink(missing_ok=True)  # peft's model-card template, every field "More information needed"
    return {"steps": sum(map(len, plan)), "train_s": round(time.monotonic() - t0, 1),
            "loss_first_epoch": sum(losses[0]) / len(losses[0]), "loss_last_epoch": sum(losses[-1]) / len(losses[-1]),
            "trainable_params": sum(p.numel() for p in lora.parameters() if p.requires_grad)}


def merged_model(base_dir: Path, adapter: Path, cache: Path) -> Path:
    """The base with ``adapter`` merged into its weights (W + B A x alpha / r), written once into ``cache`` beside the
    base's tokenizer and chat template: a plain model that answers as the adapter does, for runs that only need its
    answers (relabelling) at the base's speed. Keyed by the adapter's identity, so a retrained adapter is merged anew."""
    from predictor.target import adapter_id, model_id

    ident = adapter_id(model_id(base_dir, base_dir.name), adapter, adapter.name)
    out = cache / f"{base_dir.name}+{ident.replace('@', '-')}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter).merge_and_unload()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed merge left
    merged.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(tmp)
    for extra in ("chat_template.jinja", "generation_config.json"):
        if (base_dir / extra).is_file() and not (tmp / extra).is_file():
            (tmp / extra).write_bytes((base_dir / extra).read_bytes())
    tmp.rename(out)  # whole or not at all: a killed merge is redone, never half read
    return out


def random_adapters(model_dir: Path, names: list[str], out: Path, rank: int = LORA_RANK, seed: int = 0) -> dict[str, Path]:
    """A peft LoRA adapter (rank ``rank`` on the query and value projections, as the committed ones) with random weights
    for each name, of the model in ``model_dir`` (a dummy-weight shape): what vLLM loads and applies is the same as for
    trained ones, so a bench of random weights pays what serving adapters costs. Written once per directory."""
    made = {n: out / n for n in names}
    if all((d / "adapter_config.json").is_file() for d in made.values()):
        return made
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    for d in made.values():
        lora = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                               init_lora_weights=False))
        lora.save_pretrained(d)
        base = lora.unload()
    return made


# --- the command line ---------------------------------------------------------------------------------------------
EPILOG = """\
examples:
  # the two adapters committed in serving/launch/lora (make adapters): 247 s for detailed alone on 2 cores
  lengthwise train-adapter --style terse --examples 192 --max-prompt-tokens 128 --out adapters/smollm2-terse
  lengthwise train-adapter --style detailed --examples 64 --max-prompt-tokens 128 --batch-size 4 --lr 1e-3 \\
      --out adapters/smollm2-detailed
  # what each one answers, in tokens: the labels its length predictor trains on (as training/labels holds them)
  lengthwise relabel --model $LENGTHWISE_DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf --lora adapters/smollm2-terse \\
      --data $LENGTHWISE_DATA/prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz --max-prompts 400 \\
      --no-text --samples 2 --max-tokens 512 --max-model-len 2304 --out terse.lengths.jsonl

styles:
""" + "\n".join(f"  {s.name}: {s.describe}" for s in STYLES.values()) + """

Exit status 2: bad input, one line.
"""


def add_parser(sub) -> argparse.ArgumentParser:
    """``lengthwise train-adapter``."""
    p = sub.add_parser("train-adapter", help="train a LoRA adapter of the served model that answers shorter or longer",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                       description="Fine-tune a LoRA adapter (peft) of the served model on ShareGPT prompts towards "
                                   "another answer length, and save it where vLLM's --lora-modules and a catalogue's "
                                   "adapter entry can load it.")
    p.add_argument("--style", required=True, choices=sorted(STYLES), help="what the adapter learns to answer")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="the adapter directory to write")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="the base: a GGUF or a Hugging Face directory (default: $LENGTHWISE_DATA's SmolLM2 GGUF)")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="ShareGPT conversations (default: $LENGTHWISE_DATA's first 15,000)")
    p.add_argument("--examples", type=int, default=256, metavar="N", help="training examples (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=160, metavar="N",
                   help="skip longer prompts: training time grows with them (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--rank", type=int, default=LORA_RANK, help="LoRA rank (default: %(default)s)")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="which examples, their order and the adapter's init")
    p.add_argument("--model-cache", type=Path, metavar="DIR", default=DEFAULT_MODEL_CACHE,
                   help="where a GGUF is converted once (default: %(default)s)")
    p.set_defaults(func=run)
    return p


def _defaults(a: argparse.Namespace) -> tuple[str, str]:
    from predictor.common import data_dir, default_sharegpt

    return a.model or str(data_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"), a.data or str(default_sharegpt())


def run(a: argparse.Namespace) -> int:
    from predictor.target import served_model_id
    from serving.launch.models import resolve_model
    from training.data.example import DataError

    model, data = _defaults(a)
    try:
        if min(a.examples, a.epochs, a.rank, a.batch_size, a.max_prompt_tokens) < 1 or a.lr <= 0:
            raise ValueError("--examples, --epochs, --rank, --batch-size and --max-prompt-tokens take positive "
                             "integers, --lr a positive number")
        if a.out.exists() and any(a.out.iterdir()):
            raise ValueError(f"--out {a.out} is not empty; give a new directory")
        model_dir = resolve_model(model, a.model_cache.expanduser())
        pairs = training_pairs(model_dir, data, STYLES[a.style], a.examples, a.max_prompt_tokens, a.seed)
    except (ValueError, FileNotFoundError, DataError) as exc:
        print(f"lengthwise train-adapter: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"{len(pairs)} '{a.style}' examples (answers: mean {sum(len(p.answer) for p in pairs) / len(pairs):.0f} "
          f"tokens, prompts: mean {sum(len(p.prompt) for p in pairs) / len(pairs):.0f}) on {model_dir}", file=sys.stderr)
    stats = train_adapter(model_dir, pairs, a.out, a.rank, 2 * a.rank, a.epochs, a.lr, a.batch_size, a.seed)
    info = {"command": shlex.join(["lengthwise", "train-adapter", *sys.argv[2:]]) if sys.argv[1:2] == ["train-adapter"]
            else None, "style": a.style, "describe": STYLES[a.style].describe, "base": served_model_id(str(model_dir)),
            "data": data, "examples": len(pairs), "answer_tokens_mean": sum(len(p.answer) for p in pairs) / len(pairs),
            "rank": a.rank, "alpha": 2 * a.rank, "target_modules": ["q_proj", "v_proj"], "epochs": a.epochs, "lr": a.lr,
            "batch_size": a.batch_size, "seed": a.seed, **stats}
    (a.out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"train-adapter: {a.out} ({stats['trainable_params']:,} trainable parameters), loss "
          f"{stats['loss_first_epoch']:.3f} -> {stats['loss_last_epoch']:.3f} in {stats['train_s']:.0f} s")
    return 0
