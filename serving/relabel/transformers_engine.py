"""The transformers engine of ``lengthwise relabel``: the served model's lengths on a host with PyTorch and transformers
but no vLLM (a GPU node of a training cluster, say), as vLLM would sample them.

``lengthwise relabel --export-jobs JOBS`` writes what is left to label (each sample's prompt token ids in the chat
template and its seed); this module labels it wherever it runs::

    python -m serving.relabel.transformers_engine JOBS RESULTS --model MODEL_DIR_OR_GGUF [--device cuda]

and ``lengthwise relabel --import-results RESULTS`` appends the results to the relabel file as the records vLLM's engine
writes. The module imports nothing of lengthwise, so the file alone can be copied to such a host.

**Sampling as vLLM samples** (``vllm/v1/sample``): the repetition penalty over the prompt's and the output's tokens
(a positive logit divided by it, a negative one multiplied), then the temperature, then top-p (the smallest set of most
likely tokens holding at least ``top_p`` of the mass), then the exponential race ``argmax p / E`` with E ~ Exp(1) that
vLLM draws with. Each sample draws its E from a hash of (seed, step, token) instead of a shared generator, so its
tokens depend on its seed alone, not on which samples shared its batch. A sample ends on the tokenizer's EOS or a stop
token of the model's generation config (the EOS counted, as vLLM counts it) or at ``max_tokens`` (``length``: vLLM
checks the cap first, so an EOS drawn as the last allowed token is ``length`` too).

**Exactness.** The same weights, float32 (TF32 off), the same prompts and sampling: the lengths follow the same
distribution as vLLM's; individual samples differ, as vLLM's own do between a CPU and a GPU build with the same seed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Job:
    """One sample to draw: its prompt (token ids in the chat template) and seed; ``key`` names it in the results."""

    key: str
    seed: int
    prompt_ids: tuple[int, ...]


@dataclass(frozen=True)
class SamplingSpec:
    """The served sampling settings (vLLM ``SamplingParams`` fields)."""

    temperature: float
    top_p: float
    repetition_penalty: float
    max_tokens: int


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) on int64 tensors holding 32-bit values; multipliers below 2^31
    keep every product inside int64, so the result is the same on every device."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5F356495) & _M32
    return x ^ (x >> 16)


def noise_at(seeds: torch.Tensor, step: int, tokens: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) noise for each row's ``tokens`` (shape (rows, k)), a pure function of (seed, step, token): each
    row is its sample's own stream, whatever else is in the batch and whichever tokens are asked for."""
    key = _mix32(seeds.to(torch.int64)[:, None] ^ _mix32(torch.tensor(step + 0x9E3779B9, device=seeds.device)))
    h = _mix32(_mix32(key ^ tokens.to(torch.int64)) + 0x2545F491)
    return ((h >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def sample(logits: torch.Tensor, seen: torch.Tensor, seeds: torch.Tensor, step: int, s: SamplingSpec) -> torch.Tensor:
    """The next token of each row, as vLLM's sampler draws it (module docstring); ``seen`` marks the tokens of each row's
    prompt and output so far (for the repetition penalty). The race runs over the tokens top-p keeps, with each token's
    own noise: the same draw as over the whole vocabulary, where the others have probability 0."""
    logits = logits.float()
    if s.repetition_penalty != 1.0:
        penalized = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    probs = torch.softmax(logits / s.temperature, dim=-1)
    if s.top_p < 1.0:
        p_sorted, order = probs.sort(dim=-1, descending=True)
        kept = (p_sorted.cumsum(dim=-1) - p_sorted) < s.top_p  # the mass of the more likely tokens; the first stays
        k = int(kept.sum(dim=-1).max())
        probs, ids = p_sorted[:, :k].masked_fill(~kept[:, :k], 0.0), order[:, :k]
    else:
        ids = torch.arange(probs.shape[-1], device=probs.device)[None, :].expand_as(probs)
    race = -torch.log(noise_at(seeds, step, ids))
    return ids.gather(1, (probs / race).argmax(dim=-1, keepdim=True)).squeeze(1)


def stop_ids(model_dir: Path) -> list[int]:
    """The token ids that end a sample: the tokenizer's EOS and the generation config's, as vLLM stops on both."""
    ids: set[int] = set()
    tok = AutoTokenizer.from_pretrained(model_dir)
    for src in (tok.eos_token_id, AutoConfig.from_pretrained(model_dir).eos_token_id):
        ids.update([src] if isinstance(src, int) else (src or []))
    try:
        gen = GenerationConfig.from_pretrained(model_dir).eos_token_id
        ids.update([gen] if isinstance(gen, int) else (gen or []))
    except OSError:  # no generation_config.json
        pass
    if not ids:
        raise ValueError(f"{model_dir}: the model names no EOS token; a sample could never stop")
    return sorted(ids)


def batches(jobs: list[Job], max_tokens: int, kv_tokens: int, attn_elems: float, max_rows: int) -> Iterator[list[Job]]:
    """Jobs in batches of similar prompt length (fewer padded positions), each within the KV budget (rows x (longest
    prompt + max_tokens) <= kv_tokens) and the prefill's attention budget (rows x longest prompt^2 <= attn_elems)."""
    rest = sorted(jobs, key=lambda j: len(j.prompt_ids))
    while rest:
        n = 0
        while n < min(len(rest), max_rows):
            longest = len(rest[n].prompt_ids)
            if (n + 1) * (longest + max_tokens) > kv_tokens or (n + 1) * longest**2 > attn_elems:
                break
            n += 1
        n = max(n, 1)
        yield rest[:n]
        rest = rest[n:]


@torch.inference_mode()
def generate(model, batch: list[Job], s: SamplingSpec, stops: torch.Tensor, pad_id: int,
             drawn: list[list[int]] | None = None) -> list[tuple[int, str]]:
    """Draw every job of ``batch`` to its end: (output tokens, finish reason) in the batch's order; the tokens
    themselves into ``drawn`` when one is given (one list per job)."""
    dev = stops.device
    rows, longest = len(batch), max(len(j.prompt_ids) for j in batch)
    ids = torch.full((rows, longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((rows, longest), dtype=torch.int64)
    for i, j in enumerate(batch):  # left-padded: every row's next token is at the same column
        ids[i, longest - len(j.prompt_ids):] = torch.tensor(j.prompt_ids)
        mask[i, longest - len(j.prompt_ids):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    vocab = model.config.vocab_size
    seen = torch.zeros((rows, vocab), dtype=torch.float32, device=dev).scatter_add_(1, ids, mask.float()) > 0
    seeds = torch.tensor([j.seed for j in batch], dtype=torch.int64, device=dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    logits, pos = out.logits[:, -1, :vocab], pos[:, -1:]
    if not bool(torch.isfinite(logits).all()):  # e.g. an attention kernel that turns a fully padded row into NaN
        raise FloatingPointError("non-finite logits after the prefill of a padded batch; rerun with --max-rows 1")
    done = torch.zeros(rows, dtype=torch.bool, device=dev)
    stopped = torch.zeros(rows, dtype=torch.bool, device=dev)
    length = torch.zeros(rows, dtype=torch.int64, device=dev)
    orig = torch.arange(rows, device=dev)  # the batch row each current row is: finished rows leave the batch
    final_len = torch.zeros(rows, dtype=torch.int64, device=dev)
    final_stop = torch.zeros(rows, dtype=torch.bool, device=dev)
    steps: list[tuple[torch.Tensor, torch.Tensor]] = []
    for step in range(s.max_tokens):
        tok = sample(logits, seen, seeds, step, s)
        live = ~done
        if drawn is not None:
            steps.append((orig, torch.where(live, tok, -1)))
        length += live.to(torch.int64)
        hit = torch.isin(tok, stops) & live
        stopped |= hit & (length < s.max_tokens)  # vLLM checks the cap before the EOS
        done |= hit | (length >= s.max_tokens)
        n_live = int((~done).sum())
        if n_live == 0:
            break
        seen[torch.arange(len(tok), device=dev), tok] = True
        tok = torch.where(live, tok, torch.full_like(tok, pad_id))
        if n_live <= 0.75 * len(tok):  # a quarter of the rows have ended: stop computing them (their KV is copied out)
            final_len[orig[done]], final_stop[orig[done]] = length[done], stopped[done]
            keep = (~done).nonzero().squeeze(1)
            cache.reorder_cache(keep)
            tok, seen, seeds, mask, pos, orig = tok[keep], seen[keep], seeds[keep], mask[keep], pos[keep], orig[keep]
            done, stopped, length = done[keep], stopped[keep], length[keep]
        mask = torch.cat([mask, torch.ones((len(tok), 1), dtype=mask.dtype, device=dev)], dim=1)
        pos = pos + 1
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :vocab]
    final_len[orig], final_stop[orig] = length, stopped
    if drawn is not None:
        table = torch.full((rows, len(steps)), -1, dtype=torch.int64, device=dev)
        for t, (who, toks) in enumerate(steps):
            table[who, t] = toks
        drawn.extend([t for t in row if t >= 0] for row in table.tolist())
    return [(int(n), "stop" if st else "length") for n, st in zip(final_len.tolist(), final_stop.tolist())]


def load_model(path: Path, device: str):
    """The served model in float32 (TF32 off, as the CPU engine computes), from a Hugging Face directory or a GGUF file
    (dequantised by transformers, which needs the ``gguf`` package); its tokenizer's directory for the stop tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if path.suffix == ".gguf":
        from transformers import AutoTokenizer

        tok_dir = Path(f"/tmp/{path.stem}.tokenizer")
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tok_dir)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        model.config.save_pretrained(tok_dir)
        return model.to(device).eval(), tok_dir
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval(), path


def read_jobs(path: Path) -> tuple[dict[str, Any], list[Job]]:
    """A jobs file: its header (sampling, the model it was prepared for) and the jobs."""
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        header = json.loads(next(f))
        return header, [Job(d["key"], int(d["seed"]), tuple(d["prompt_ids"])) for d in map(json.loads, f)]


def run(jobs_path: Path, results: Path, model_path: Path, device: str, kv_tokens: int, attn_elems: float,
        max_rows: int, stop_after: float | None = None) -> dict[str, Any]:
    """Label every job not yet in ``results`` (append-only, so a stopped run resumes) and say how fast it went.
    With ``stop_after`` seconds, no batch starts that the last batch's time says would end past it: a run on a lent
    machine with a hard limit ends cleanly rather than losing the batch it was killed in."""
    header, jobs = read_jobs(jobs_path)
    s = SamplingSpec(**header["sampling"], max_tokens=int(header["max_tokens"]))
    done = set()
    if results.exists():
        done = {json.loads(line)["key"] for line in results.read_text().splitlines() if line.strip()}
    todo = [j for j in jobs if j.key not in done]
    t0 = time.monotonic()
    model, tok_dir = load_model(model_path, device)
    stops = torch.tensor(stop_ids(tok_dir), device=device)
    pad_id = int(stops[0])
    loaded, n, tokens = time.monotonic(), 0, 0
    work = list(batches(todo, s.max_tokens, kv_tokens, attn_elems, max_rows))[::-1]
    last_s = 0.0
    with open(results, "a") as f:
        while work:
            if stop_after is not None and time.monotonic() - t0 + last_s > stop_after:
                print(f"relabel_torch: stopping with {len(todo) - n} samples left (--stop-after {stop_after:.0f})",
                      file=sys.stderr, flush=True)
                break
            batch, started = work.pop(), time.monotonic()
            try:
                drawn = generate(model, batch, s, stops, pad_id)
            except torch.OutOfMemoryError:  # the budgets were too generous for this device: halve the batch
                if len(batch) == 1:
                    raise
                torch.cuda.empty_cache()
                work += [batch[len(batch) // 2:], batch[:len(batch) // 2]]
                print(f"relabel_torch: out of memory with {len(batch)} samples, halving", file=sys.stderr)
                continue
            for j, (length, reason) in zip(batch, drawn):
                f.write(json.dumps({"key": j.key, "seed": j.seed, "output_tokens": length, "finish_reason": reason,
                                    "prompt_tokens": len(j.prompt_ids)}) + "\n")
                tokens += length
            f.flush()
            n, last_s = n + len(batch), time.monotonic() - started
            el = time.monotonic() - loaded
            print(f"relabel_torch: {n}/{len(todo)} samples, {tokens} output tokens, {el:.0f} s, "
                  f"{tokens / max(el, 1e-9):.0f} out tok/s", file=sys.stderr, flush=True)
    return {"samples": n, "left": len(todo) - n, "output_tokens": tokens, "load_s": round(loaded - t0, 1),
            "generate_s": round(time.monotonic() - loaded, 1), "device": torch.cuda.get_device_name() if device == "cuda"
            else device, "torch": torch.__version__, "transformers": transformers.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.relabel.transformers_engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", type=Path, help="the jobs file `lengthwise relabel --export-jobs` wrote")
    p.add_argument("results", type=Path, help="the results JSONL to append to (resumes: jobs already there are skipped)")
    p.add_argument("--model", type=Path, required=True, help="the served model: a Hugging Face directory or a GGUF file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kv-tokens", type=int, default=1_000_000,
                   help="rows x (longest prompt + max_tokens) per batch (default: %(default)s; float32 SmolLM2-135M "
                        "holds 46 KB of KV per token)")
    p.add_argument("--attn-elems", type=float, default=4e8, help="rows x longest prompt^2 per batch (prefill memory)")
    p.add_argument("--max-rows", type=int, default=1024, help="samples per batch at most (default: %(default)s)")
    p.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="start no batch that would end past this many seconds after launch (for a machine lent "
                        "for a fixed time; the results file resumes next time)")
    a = p.parse_args(argv)
    if not a.jobs.is_file():
        print(f"relabel_torch: error: no jobs file {a.jobs}", file=sys.stderr)
        return 2
    if not a.model.exists():
        print(f"relabel_torch: error: no model at {a.model}", file=sys.stderr)
        return 2
    stats = run(a.jobs, a.results, a.model, a.device, a.kv_tokens, a.attn_elems, a.max_rows, a.stop_after)
    a.results.with_name(a.results.name + ".run.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
