"""The whole predictor job: data → labels → split → train (Lightning) → evaluate vs baselines →
ONNX export + parity → MLflow logging → registration and aliases. The CLI and the benchmark call this.

Each step is a function of its own and :func:`run` calls them in that order; ``prepare``, ``evaluate_all`` and
``config_from_params`` are also what notebooks/predictor_quality.ipynb re-runs on a registered model. The settings,
:class:`TrainConfig`, are defined in training.config (the command line reads them there) and re-exported here."""

from __future__ import annotations

import importlib
import json
import logging
import tempfile
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from predictor.buckets import BucketScheme
from predictor.common import compute_threads, default_tokenizer, silence_loggers
from training.config import TrainConfig
from training.data import DataError, Example, Turn, load_examples
from training.data.labels import TokenCounter, attach_labels, censored_of, labels_of, load_counter
from training.data.served import ServedLabels, group_samples, join_served_lengths, load_served, table_target
from training.distill import describe, judge, package_dir, score, student_targets, teacher_probs
from training.split import Splits, cap_groups, split_by_group, split_of

if TYPE_CHECKING:
    from predictor.prompt import InputFormat

__all__ = ["Prepared", "TrainConfig", "config_from_params", "evaluate_all", "prepare", "run"]

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    splits: Splits
    scheme: BucketScheme
    counter: TokenCounter  # the target model's tokenizer, also used for prompt lengths in evaluation
    target: dict | None = None  # whose lengths the labels are (predictor.target): recorded in the package and registry
    served: ServedLabels | None = None  # the served-length file's labels, with --served-lengths
    undecided: dict[str, int] | None = None  # cut answers left out of validation and test (no known bucket)
    pretrain: list[Example] | None = None  # with pretrain_epochs or aux_weight: the data's own answers, training
    # conversations only
    models: list[str] | None = None  # with condition_on_model: the served models the predictor reads the names of


def prepare(cfg: TrainConfig) -> Prepared:
    """Load, label, cap and split the data, and fix the bucket scheme (centers from training labels).

    With served lengths every split holds one example per sample (a prompt's samples share its group, so they never
    straddle a split); ``--label soft`` regroups the training split later (:func:`_encode`), so both label modes are
    scored on the same test rows.
    """
    scheme = (BucketScheme.parse(cfg.edges, cfg.max_tokens) if cfg.edges
              else BucketScheme.equal_width(200 if cfg.bucket_width is None else int(cfg.bucket_width), cfg.max_tokens))
    if cfg.label == "soft" and not cfg.served_lengths:
        raise DataError("--label soft needs --served-lengths: soft labels are the bucket histogram of a prompt's samples")
    if cfg.pretrain_epochs and not cfg.served_lengths:
        raise DataError("--pretrain-epochs needs --served-lengths: without them the data's answers are the labels already")
    if cfg.aux_weight and not cfg.served_lengths:
        raise DataError("--aux-weight needs --served-lengths: without them the data's answers are the labels already")
    if cfg.finetune_lr and not cfg.pretrain_epochs:
        raise DataError("--finetune-lr is the second stage's learning rate: it needs --pretrain-epochs (else use --lr)")
    if cfg.aux_weight and cfg.pretrain_epochs:
        raise DataError("--aux-weight and --pretrain-epochs are two ways to learn from the data's answers (at the same "
                        "time, or first): choose one")
    counter = load_counter(cfg.tokenizer or default_tokenizer())
    kwargs = {"generator": cfg.generator, "first_turn_only": cfg.first_turn_only}
    examples = load_examples(cfg.data, cfg.fmt, **kwargs)
    models = _condition(examples) if cfg.condition_on_model else None
    served = load_served(cfg.served_lengths) if cfg.served_lengths else None
    if served is not None:
        _check_censored(served, scheme)
        examples = join_served_lengths(examples, served)
    examples = cap_groups(examples, cfg.max_samples, cfg.seed)
    attach_labels(examples, counter)
    splits = split_by_group(examples, seed=cfg.seed)
    splits, undecided = _decided_eval(splits, scheme)
    if not splits.train or not splits.val or not splits.test:
        raise DataError(f"too few conversations to split ({len(examples)} examples): need data for train, val and test")
    train_decided = scheme.decided(labels_of(splits.train), censored_of(splits.train))
    scheme = scheme.with_centers(labels_of(splits.train)[train_decided])
    pretrain = _pretrain_examples(cfg, counter) if cfg.pretrain_epochs or cfg.aux_weight else None
    return Prepared(splits, scheme, counter, _target(cfg, served), served, undecided, pretrain, models)


def _condition(examples: list[Example]) -> list[str]:
    """Write each row's model before its request (in place) and return the models; a row without one is an error."""
    from predictor.conditioning import conditioned_text

    missing = sum(e.model is None for e in examples)
    if missing:
        raise DataError(f"--condition-on-model needs a 'model' column naming the served model that answered each row; "
                        f"{missing} of {len(examples)} rows have none")
    for e in examples:
        e.turns = (*e.turns[:-1], Turn(e.turns[-1].role, conditioned_text(e.model, e.turns[-1].text)))
    return sorted({e.model for e in examples})


def _pretrain_examples(cfg: TrainConfig, counter: TokenCounter) -> list[Example]:
    """The data's own answers (counted by the target's tokenizer) for every conversation :func:`split_by_group` puts in
    training: no validation or test prompt is seen by either stage. Every prompt of the slice, not only the ones the
    served model answered: a dataset's answer has no sampling noise, so it teaches the encoder what makes an answer long
    before the served model's noisier samples say how long that model answers."""
    examples = load_examples(cfg.data, cfg.fmt, generator=cfg.generator, first_turn_only=cfg.first_turn_only)
    examples = [e for e in examples if split_of(e.group, seed=cfg.seed) == "train" and e.response]
    examples = attach_labels(cap_groups(examples, cfg.pretrain_samples, cfg.seed), counter)
    if not examples:
        raise DataError("--pretrain-epochs/--aux-weight: the data has no answers of training conversations to learn from")
    return examples


def _decided_eval(splits: Splits, scheme: BucketScheme) -> tuple[Splits, dict[str, int]]:
    """Validation and test keep only labels whose bucket is known: a cut answer below the last bucket has no true
    bucket to score against (it trains, as a lower bound). Returns the splits and how many rows each lost."""
    def keep(part: list[Example]) -> list[Example]:
        if not part:
            return part
        mask = scheme.decided(labels_of(part), censored_of(part))
        return [e for e, k in zip(part, mask) if k]

    val, test = keep(splits.val), keep(splits.test)
    return Splits(splits.train, val, test), {"val": len(splits.val) - len(val), "test": len(splits.test) - len(test)}


def _check_censored(served: ServedLabels, scheme: BucketScheme) -> None:
    """Censored samples (they ran to the cap) keep the cap as their length, which lands them in the top bucket only
    when the top bucket starts at or below the cap; otherwise their bucket would claim a length nobody observed."""
    cap = served.max_tokens
    if served.censored and cap is not None and scheme.edges[-1] > cap:
        raise DataError(f"{served.censored} served samples ran to their cap of {cap} tokens (censored), but the top bucket "
                        f"starts at {scheme.edges[-1]}: pass --max-tokens {cap} (or edges up to {cap}) so they land in "
                        "the top bucket")


def _target(cfg: TrainConfig, served: ServedLabels | None) -> dict:
    """Whose lengths the labels are (:mod:`predictor.target`): the served model's when they come from a relabel (the
    ``--served-lengths`` file, or a jsonl dataset whose rows name their model), else the dataset's answers (counted by
    the label tokenizer, up to ``max_tokens``)."""
    if served is not None:
        return served.target()
    # rows naming several models are the conditioned predictor's data (meta.json lists them), not one relabel's
    if (cfg.fmt == "jsonl" and not cfg.served_lengths and not cfg.condition_on_model
            and (named := table_target(cfg.data)) is not None):
        return named
    return {"model": _dataset_answers(cfg),
            "label_tokenizer": Path(str(cfg.tokenizer or default_tokenizer())).name,
            "sampling": None, "max_tokens": cfg.max_tokens, "source": "dataset answers"}


def _turns(e: Example) -> list[tuple[str, str]]:
    return [(t.role, t.text) for t in e.turns]


@dataclass
class _Inputs:
    """The backbone the predictor fine-tunes and every split encoded for it, with bucket labels."""

    base: Path            # the backbone's Hugging Face directory
    model_type: str       # its config's model_type (picks the default LoRA targets)
    fmt_in: InputFormat   # how a prompt is cut and framed for the backbone
    enc: dict[str, list]  # "train", "val", "test": the encoded prompts
    y: dict[str, np.ndarray]  # the same splits' bucket indices; with soft labels "train" is [prompts, buckets]
    lengths: dict[str, np.ndarray]  # the true lengths the ranking term orders by (soft: a prompt's mean over samples)


@dataclass
class _Trained:
    """What training left: the best checkpoint's model, and how the fit went."""

    model: Any
    train_seconds: float
    epoch_seconds: list[float]
    epochs_run: int
    best_val_acc: float


# imported as the job starts, before silence_loggers(): libraries set their log levels on import
_LIBRARIES = ("lightning", "mlflow", "torch", "lightning.pytorch.callbacks", "lightning.pytorch.loggers", "predictor.common",
              "predictor.model", "predictor.prompt", "predictor.runtime", "registry.store", "training.export", "training.module")


def run(cfg: TrainConfig) -> dict:
    """Run the job; returns the report dict that ``--output-json`` writes.

    The steps, in order: :func:`prepare` (data, labels, split, buckets), :func:`_encode`, :func:`_build_module`,
    :func:`_train`, :func:`_export` (ONNX and parity), :func:`evaluate_all` (vs the baselines), :func:`_route` (the
    baseline that wins a slice ships for it), :func:`_log_results` (MLflow) and :func:`_register` (version, alias,
    promotion).
    """
    from predictor.tracking import ensure_experiment
    from registry import store

    store.check_reachable()  # before minutes of data and training, not at the first log line
    t0 = time.perf_counter()
    if cfg.base_model:
        _check_backbone(Path(cfg.base_model))
    # the data first: a mistake in it (a missing file, a wrong format, a bad bucket edge) is reported in seconds,
    # not after the ~10 s it takes to import torch and Lightning
    prep = prepare(cfg)
    for name in _LIBRARIES:
        importlib.import_module(name)
    import mlflow
    import torch

    silence_loggers()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(compute_threads())
    inputs = _encode(cfg, prep)
    module, lora, train_dl, val_dl = _build_module(cfg, prep, inputs)
    exp_id = ensure_experiment(cfg.experiment)
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="lengthwise-train-"))
    work.mkdir(parents=True, exist_ok=True)
    params = _run_params(cfg, prep, inputs, lora)
    with mlflow.start_run(experiment_id=exp_id) as run_:
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        pretrained = _pretrain(cfg, inputs, module, val_dl, work, run_.info.run_id) if cfg.pretrain_epochs else None
        if pretrained and cfg.finetune_lr:
            module.lr = cfg.finetune_lr
        trained = _train(cfg, module, train_dl, val_dl, work, run_.info.run_id)
        model, distilled = trained.model, None
        if cfg.distill_to:  # a smaller student of the trained model; it replaces it only if as good (training.distill)
            model, distilled = _distill(cfg, prep, inputs, trained.model, work, run_.info.run_id)
        shipped = {"student": distilled["student_meta"]} if distilled and distilled["ships"] == "student" else None
        package, onnx_pred, parity = _export(cfg, prep, inputs, model, work, shipped)
        fitted: dict[str, dict] = {}
        report = evaluate_all(cfg, prep, onnx_pred, inputs.enc, work, fitted)
        report["routes"] = _route(cfg, package, report, fitted)
        report["fast_tier"] = _fast_tier(package, report, fitted)
        report["distillation"] = distilled
        report["pretrain"] = pretrained
        report["auxiliary"] = _stages(cfg, prep)[-1].get("auxiliary")
        splits = prep.splits
        report.update(
            onnx_parity_max_abs_diff=parity, train_seconds=trained.train_seconds, epoch_seconds=trained.epoch_seconds,
            epochs_run=trained.epochs_run, best_epoch_val_acc=trained.best_val_acc,
            n_train=len(splits.train), n_val=len(splits.val), n_test=len(splits.test), eval_split=splits.fingerprint(),
            buckets=prep.scheme.to_dict(), base_model=str(inputs.base), run_id=run_.info.run_id,
            tracking_uri=store.tracking_uri(),
        )
        _log_results(report, parity, trained.train_seconds, work)
        report["model_uri"] = f"runs:/{run_.info.run_id}/length_predictor"
        if cfg.register:
            _register(cfg, prep, package, report)
        if parity >= 1e-3:
            log.error("ONNX parity check failed: max |logit diff| %.2e >= 1e-3", parity)
        report["total_seconds"] = time.perf_counter() - t0
        (work / "metrics.json").write_text(json.dumps(report, indent=2, default=float))
        mlflow.log_artifact(str(work / "metrics.json"))
    if cfg.output_json:
        Path(cfg.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output_json).write_text(json.dumps(report, indent=2, default=float))
    return report


def _check_backbone(base: Path) -> None:
    """A backbone directory without ``config.json`` is the caller's error, said in one line."""
    if not (base / "config.json").exists():
        from training.data import DataError

        raise DataError(f"--base-model {base} is not a Hugging Face model directory (no config.json)")


def _encode(cfg: TrainConfig, prep: Prepared) -> _Inputs:
    """The backbone's tokenizer and input format, and every split encoded and labelled with its buckets."""
    from predictor.model import default_backbone_path
    from predictor.prompt import encode_turns
    from training.export import input_format_for, load_backbone_tokenizer

    splits, scheme = prep.splits, prep.scheme
    base = Path(cfg.base_model) if cfg.base_model else default_backbone_path()
    if not cfg.base_model:  # a given path was checked in run(), before the data
        _check_backbone(base)
    tok = load_backbone_tokenizer(base)
    from transformers import AutoConfig

    base_config = AutoConfig.from_pretrained(base, local_files_only=True)
    model_type = base_config.model_type
    if cfg.distill_to:  # before any training: a student the backbone cannot give is the caller's error
        from predictor.model import layers_kept
        from training.data import DataError

        try:
            layers_kept(int(getattr(base_config, "num_hidden_layers", 0)), cfg.distill_to)
        except ValueError as exc:
            raise DataError(f"--distill-to: {exc}") from None
    fmt_in = input_format_for(tok, cfg.max_prompt_tokens, None, cfg.length_hints)
    parts = {"train": splits.train, "val": splits.val, "test": splits.test}
    y = {name: scheme.assign(labels_of(part)) for name, part in parts.items()}
    lengths = {name: labels_of(part).astype(np.float64) for name, part in parts.items()}
    if cfg.label == "soft":
        grouped = group_samples(splits.train)
        parts["train"] = [e for e, _ in grouped]
        y["train"] = label_targets([n for _, n in grouped], scheme)
        lengths["train"] = np.array([np.mean([n for n, _ in samples]) for _, samples in grouped])
    elif censored_of(splits.train).any():  # lower bounds train by their likelihood, not as short answers
        y["train"] = label_targets([[(e.response_tokens or 0, e.censored)] for e in splits.train], scheme)
    if prep.pretrain:  # the data's own answers: exact lengths, one example each
        parts["pretrain"] = prep.pretrain
        y["pretrain"] = scheme.assign(labels_of(prep.pretrain))
        lengths["pretrain"] = labels_of(prep.pretrain).astype(np.float64)
    enc = {name: encode_turns(tok, fmt_in, [_turns(e) for e in part]) for name, part in parts.items()}
    return _Inputs(base, model_type, fmt_in, enc, y, lengths)


def label_targets(samples: list[list[tuple[int, bool]]], scheme: BucketScheme) -> np.ndarray:
    """``[prompts, 2 * buckets]`` for :func:`training.module.censored_cross_entropy`: per prompt, the share of its
    ``(length, censored)`` samples observed in each bucket, then the share cut inside each bucket (lower bounds). A
    sample cut in the last bucket is an exact observation there (every longer answer lands in it too)."""
    out = np.zeros((len(samples), 2 * scheme.n))
    for row, sample in zip(out, samples):
        lengths = np.array([n for n, _ in sample])
        cols = scheme.assign(lengths) + scheme.n * ~scheme.decided(lengths, [c for _, c in sample])
        np.add.at(row, cols, 1.0 / len(sample))
    return out


def _build_module(cfg: TrainConfig, prep: Prepared, inputs: _Inputs) -> tuple[Any, Any, Any, Any]:
    """The LoRA-wrapped classifier in its Lightning module, and the train and validation loaders:
    (module, LoRA spec, train loader, validation loader)."""
    from predictor.model import LoraSpec, build_classifier, default_targets
    from training.module import LengthModule, make_loader

    lora = LoraSpec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets or default_targets(inputs.model_type))
    model = build_classifier(inputs.base, prep.scheme.n, lora, aux_buckets=prep.scheme.n if cfg.aux_weight else 0)
    module = LengthModule(model, prep.scheme.centers, lr=cfg.lr, rank_loss_weight=cfg.rank_loss_weight,
                          aux_weight=cfg.aux_weight)
    enc, y, n, pad_id = inputs.enc, inputs.y, inputs.lengths, inputs.fmt_in.pad_id
    train_dl = make_loader([e.ids for e in enc["train"]], y["train"].tolist(), pad_id, cfg.batch_size, True, cfg.seed,
                           n["train"].tolist())
    if cfg.aux_weight:  # each step one served batch and one of the data's answers; an epoch is one served pass
        from lightning.pytorch.utilities import CombinedLoader

        answers = make_loader([e.ids for e in enc["pretrain"]], y["pretrain"].tolist(), pad_id, cfg.batch_size, True,
                              cfg.seed + 1, n["pretrain"].tolist(), batches_per_epoch=len(train_dl))
        train_dl = CombinedLoader({"served": train_dl, "answers": answers}, mode="min_size")
    val_dl = make_loader([e.ids for e in enc["val"]], y["val"].tolist(), pad_id, 64, False, cfg.seed, n["val"].tolist())
    return module, lora, train_dl, val_dl


def _run_params(cfg: TrainConfig, prep: Prepared, inputs: _Inputs, lora: Any) -> dict:
    """The MLflow params of the run: every TrainConfig field (what :func:`config_from_params` reads back), with the
    backbone, the LoRA targets and the label tokenizer resolved, and the split's sizes and fingerprint."""
    splits = prep.splits
    params = dict(cfg.model_dump())
    params.update(base_model=str(inputs.base), model_type=inputs.model_type, n_buckets=prep.scheme.n,
                  n_train=len(splits.train), n_val=len(splits.val), n_test=len(splits.test), n_pretrain=len(prep.pretrain or []),
                  lora_targets=",".join(lora.target_modules), eval_split=splits.fingerprint(),
                  label_tokenizer=str(cfg.tokenizer or default_tokenizer()))
    return params


def _stages(cfg: TrainConfig, prep: Prepared) -> list[dict]:
    """What each training stage learnt from, in order (the package's ``stages``; the registry's ``lengthwise.stages``)."""
    served = {"labels": str((prep.target or {}).get("model")), "data": str(cfg.served_lengths or cfg.data),
              "examples": len(prep.splits.train)}
    if cfg.aux_weight:  # one stage, the data's answers beside it on the second head
        served["auxiliary"] = {"labels": _dataset_answers(cfg), "data": str(cfg.data), "examples": len(prep.pretrain or []),
                               "weight": cfg.aux_weight}
    if not cfg.pretrain_epochs:
        return [served]
    served["lr"] = cfg.finetune_lr or cfg.lr
    return [{"labels": _dataset_answers(cfg), "data": str(cfg.data), "examples": len(prep.pretrain), "lr": cfg.lr}, served]


def _dataset_answers(cfg: TrainConfig) -> str:
    """What labels counted from the data's own answers are called (a target's model, the first stage's labels)."""
    return f"dataset answers ({cfg.generator or cfg.fmt})"


def _pretrain(cfg: TrainConfig, inputs: _Inputs, module: Any, val_dl: Any, work: Path, run_id: str) -> dict:
    """The first stage (``pretrain_epochs``): ``module`` trained on the data's own answers, early-stopped on the served
    validation split (what the second stage is judged on), its best checkpoint loaded back; returns what the report
    and MLflow keep of it (curves under ``pretrain-``)."""
    from training.module import make_loader

    enc, y, n = inputs.enc["pretrain"], inputs.y["pretrain"], inputs.lengths["pretrain"]
    loader = make_loader([e.ids for e in enc], y.tolist(), inputs.fmt_in.pad_id, cfg.batch_size, True, cfg.seed, n.tolist())
    stage = _train(cfg.model_copy(update={"epochs": cfg.pretrain_epochs}), module, loader, val_dl, work / "pretrain",
                   run_id, prefix="pretrain")
    return {"labels": _dataset_answers(cfg), "examples": len(enc),
            "epoch_seconds": stage.epoch_seconds, "best_val_acc": stage.best_val_acc, "train_seconds": stage.train_seconds}


def _train(cfg: TrainConfig, module: Any, train_dl: Any, val_dl: Any, work: Path, run_id: str, prefix: str = "") -> _Trained:
    """Fit with early stopping on validation accuracy, logging to the open MLflow run (every key under ``prefix-`` when
    given: a distilled student's curves beside its teacher's); the best checkpoint is loaded back."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import MLFlowLogger

    from registry import store

    logger = MLFlowLogger(experiment_name=cfg.experiment, tracking_uri=store.tracking_uri(), run_id=run_id, prefix=prefix)
    ckpt = ModelCheckpoint(dirpath=work / "ckpt", monitor="val_acc", mode="max", save_top_k=1, save_weights_only=True)
    from training.progress import PlainProgress, on_a_terminal

    bar = on_a_terminal()  # Lightning's bar on a terminal; plain lines a log file shows, elsewhere
    trainer = L.Trainer(
        max_epochs=cfg.epochs, accelerator="cpu", devices=1, logger=logger, deterministic=False,
        callbacks=[EarlyStopping(monitor="val_acc", mode="max", patience=cfg.patience), ckpt,
                   *([] if bar else [PlainProgress()])],
        enable_progress_bar=bar, log_every_n_steps=20, num_sanity_val_steps=0, enable_model_summary=False,
    )
    t_train = time.perf_counter()
    trainer.fit(module, train_dl, val_dl)
    train_seconds = time.perf_counter() - t_train
    epoch_times = [float(v) for v in _metric_history(run_id, f"{prefix}-epoch_time_s" if prefix else "epoch_time_s")]
    if ckpt.best_model_path:
        state = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=False)["state_dict"]
        module.load_state_dict(state)
    return _Trained(module.model.eval(), train_seconds, epoch_times, int(trainer.current_epoch),
                    float(ckpt.best_model_score or float("nan")))


def _export(cfg: TrainConfig, prep: Prepared, inputs: _Inputs, model: Any, work: Path, extra_meta: dict | None = None,
            out: Path | None = None, fused: bool = True) -> tuple[Path, Any, float]:
    """The ONNX package (``out``, default ``work/package``; ``extra_meta`` added to its meta.json), its predictor, and
    the largest logit difference from the torch model on test prompts: (package, ONNX predictor, parity)."""
    from predictor.conditioning import META_KEY
    from predictor.partial import META_KEY as REMAINING_KEY
    from predictor.runtime import OnnxLengthPredictor
    from training.export import export_package, parity_max_abs_diff

    base, splits = inputs.base, prep.splits
    remaining = any(e.turns[-1].role == "assistant" for e in splits.train)  # trained on answers so far
    package = export_package(model, out or work / "package", base, prep.scheme, inputs.fmt_in, {
        "backbone": str(base.name), "model_type": inputs.model_type,
        "label_tokenizer": Path(str(cfg.tokenizer or default_tokenizer())).name,
        "trained_on": str(cfg.data), "format": cfg.fmt, "generator": cfg.generator, "eval_split": splits.fingerprint(),
        "stages": _stages(cfg, prep), **({META_KEY: prep.models} if prep.models else {}),
        **({REMAINING_KEY: True} if remaining else {}), **(extra_meta or {}),
    }, target=prep.target)
    onnx_pred = OnnxLengthPredictor(package)
    test_ids = [e.ids for e in inputs.enc["test"]]
    parity_ids = test_ids[:: max(1, len(test_ids) // 256)][:256]
    if cfg.optimize and fused:  # the fused graph ships in the package (meta.json records it): serving it needs no optimizer
        from predictor.runtime import add_fused_variant

        add_fused_variant(package, parity_ids)
    return package, onnx_pred, parity_max_abs_diff(model, onnx_pred, parity_ids)


def _distill(cfg: TrainConfig, prep: Prepared, inputs: _Inputs, teacher: Any, work: Path, run_id: str) -> tuple[Any, dict]:
    """Train a student of ``cfg.distill_to`` layers on the teacher's probabilities and the labels, export both, score
    both on the test rows and keep the one :func:`training.distill.judge` picks: (that model, the report's block)."""
    import mlflow

    from predictor.model import layers_kept, student_of
    from predictor.runtime import OnnxLengthPredictor
    from training.module import LengthModule, make_loader

    enc, pad_id, n = inputs.enc, inputs.fmt_in.pad_id, inputs.lengths
    t0 = time.perf_counter()
    targets = student_targets(inputs.y["train"], teacher_probs(teacher, [e.ids for e in enc["train"]], pad_id),
                              cfg.distill_alpha)
    teacher_layers = int(teacher.backbone.config.num_hidden_layers)
    student = student_of(teacher, cfg.distill_to)
    module = LengthModule(student, prep.scheme.centers, lr=cfg.distill_lr, rank_loss_weight=cfg.rank_loss_weight)
    train_dl = make_loader([e.ids for e in enc["train"]], targets.tolist(), pad_id, cfg.batch_size, True, cfg.seed,
                           n["train"].tolist())
    val_dl = make_loader([e.ids for e in enc["val"]], inputs.y["val"].tolist(), pad_id, 64, False, cfg.seed,
                         n["val"].tolist())
    trained = _train(cfg, module, train_dl, val_dl, work / "student", run_id, prefix="student")
    y_len = labels_of(prep.splits.test).astype(np.float64)
    scores = {}
    for role, model in (("teacher", teacher), ("student", trained.model)):
        pkg, _, _ = _export(cfg, prep, inputs, model, work, out=package_dir(work, role), fused=False)
        scores[role] = score(OnnxLengthPredictor(pkg), enc["test"], y_len, prep.scheme, cfg.padding)
    verdict = judge(scores["teacher"], scores["student"], cfg.distill_max_top1_drop, cfg.distill_max_tau_drop)
    meta = describe(cfg.distill_to, teacher_layers, layers_kept(teacher_layers, cfg.distill_to), cfg.distill_alpha)
    mlflow.log_metrics({f"distill_{role}_{k}": v for role, m in scores.items() for k, v in m.items()})
    mlflow.set_tag("distill_ships", verdict.ships)
    log.info("distillation: the %s ships (%s)", verdict.ships, verdict.reason)
    block = dict(verdict.to_dict(), student_meta=meta, student_train_seconds=trained.train_seconds,
                 student_epochs_run=trained.epochs_run, seconds=time.perf_counter() - t0)
    return (trained.model if verdict.ships == "student" else teacher), block


def _route(cfg: TrainConfig, package: Path, report: dict, fitted: dict[str, dict]) -> dict | None:
    """Ship per slice the predictor the report recommends, when it is a baseline that can serve (training.routing):
    its file and the routing table go into the package. None with ``--route-slices off``."""
    from training.routing import ship_routes

    return ship_routes(package, report, fitted, cfg.route_slices, cfg.route_max_top1_drop, cfg.route_max_tau_drop)


def _fast_tier(package: Path, report: dict, fitted: dict[str, dict]) -> dict | None:
    """Ship the per-slice TF-IDF models as the package's fast tier (training.routing.ship_fast_tier): a saturated
    sidecar's answer instead of the caller's constant fallback. None without baselines."""
    from training.routing import ship_fast_tier

    return ship_fast_tier(package, report, fitted)


def _log_results(report: dict, parity: float, train_seconds: float, work: Path) -> None:
    """The test metrics of the model and of each baseline (overall, as ``test_*``/``baseline_*``, and per slice, as
    ``<slice>_<predictor>_<metric>``), the recommended predictor per slice (tags ``recommended_<slice>``), the parity,
    the training time and the plots, to MLflow."""
    import mlflow

    mlflow.log_metrics({f"test_{k}": v for k, v in report["model"].items() if isinstance(v, (int, float))})
    mlflow.log_metric("onnx_parity_max_abs_diff", parity)
    mlflow.log_metric("train_seconds", train_seconds)
    for b, m in report["baselines"].items():
        mlflow.log_metrics({f"baseline_{b}_{k}": v for k, v in m.items() if isinstance(v, (int, float))})
    for s, block in report["slices"].items():
        for name, m in block.items():
            mlflow.log_metrics({f"{s}_{name}_{k}": v for k, v in m.items() if isinstance(v, (int, float))})
    mlflow.set_tags({f"recommended_{s}": name for s, name in report["recommended"].items()})
    mlflow.set_tag("recommended_by", report["recommended_by"])
    mlflow.log_artifacts(str(work / "plots"), "plots")


def _register(cfg: TrainConfig, prep: Prepared, package: Path, report: dict) -> None:
    """Register the package as a new version of ``cfg.register``, alias it, and promote it if asked; noted in ``report``."""
    from registry import store
    from training.routing import served_slice_metrics

    reg = store.register_package(package, cfg.register, report["model"], prep.splits.fingerprint(), list(prep.scheme.edges),
                                 target=prep.target, slices=served_slice_metrics(report, report.get("routes")))
    report.update(model_uri=reg.model_uri, registered_name=reg.name, registered_version=reg.version)
    if cfg.alias:
        store.set_alias(reg.name, cfg.alias, reg.version)
        report["alias"] = cfg.alias
    if cfg.promote:
        try:
            report["promotion"] = store.promote(reg.name, reg.version, store.CHAMPION, cfg.force)
        except store.PromotionRefused as exc:
            report["promotion"] = f"refused: {exc}"


def _metric_history(run_id: str, key: str) -> list[float]:
    from mlflow import MlflowClient

    return [m.value for m in sorted(MlflowClient().get_metric_history(run_id, key), key=lambda m: m.step)]


def evaluate_all(cfg: TrainConfig, prep: Prepared, predictor, enc: dict, work: Path,
                 fitted: dict[str, dict] | None = None) -> dict:
    """Our model and the baselines on the test split: metrics overall and per slice (first turns, later turns), the
    recommended predictor per slice, accuracy at 100/200/400, plots.

    ``report["model"]`` and ``report["baselines"]`` hold the metrics on all test rows (what the registry compares);
    ``report["slices"][slice][predictor]`` the same metrics per slice, and ``report["recommended"][slice]`` the
    predictor with the best pairwise ranking accuracy there (what :func:`_route` ships for that slice). Each baseline is
    fitted per slice (:func:`training.baselines.fit_sliced`); ``fitted``, when given, receives them as
    ``{baseline: {slice: fitted baseline}}``. With served lengths a held-out prompt is scored once per sample, whatever
    the label mode trained on.
    """
    from training.baselines import BASELINES, exact_labelled, fit_sliced, rows_of
    from training.evaluate import (
        RECOMMEND_BY,
        Predictions,
        accuracy_at_widths,
        compute_metrics,
        recommend,
        slice_masks,
        sliced_metrics,
    )
    from training.plots import confusion_png, error_by_prompt_length_png, reliability_png

    splits, scheme = prep.splits, prep.scheme
    test = splits.test
    y_len = labels_of(test).astype(np.float64)
    masks = slice_masks(test)
    batch = predictor.predict_encoded(enc["test"], cfg.quantile)
    ours = Predictions(batch.probs, batch.expected)
    report = {"model": compute_metrics(ours, y_len, scheme, cfg.padding)}
    report["model"]["quantile"] = cfg.quantile
    report["model"]["under_prediction_rate_at_quantile"] = float((y_len > batch.quantile).mean())
    report["model"]["truncated_prompts"] = float(batch.truncated.mean())
    report["accuracy_at_widths"] = {"lengthwise": accuracy_at_widths(ours, scheme, y_len)}
    per_slice = {"lengthwise": sliced_metrics(ours, y_len, scheme, masks, cfg.padding)}
    # full (untruncated) prompt length in target-model tokens: what Aladdin's predictor conditions on
    base_train = exact_labelled(splits.train, scheme)
    rows = {k: rows_of(part, prep.counter.count(["\n".join(t.text for t in e.turns) for e in part]))
            for k, part in (("train", base_train), ("val", splits.val), ("test", test))}
    report["baselines"], report["baseline_fits"] = {}, {}
    errors = {"lengthwise": ours.point - y_len}
    if cfg.baselines:
        for make in BASELINES:
            per_part: dict = {}
            p, info = fit_sliced(make, scheme, rows["train"], rows["val"], rows["test"], fitted=per_part)
            name = make.name
            if fitted is not None:
                fitted[name] = per_part
            report["baselines"][name] = compute_metrics(p, y_len, scheme, cfg.padding)
            report["baseline_fits"][name] = info
            report["accuracy_at_widths"][name] = accuracy_at_widths(p, scheme, y_len)
            per_slice[name] = sliced_metrics(p, y_len, scheme, masks, cfg.padding)
            errors[name] = p.point - y_len
    report["slices"] = {s: {name: m[s] for name, m in per_slice.items()} for s in masks}
    report["recommended"] = {s: recommend(block) for s, block in report["slices"].items()}
    report["recommended_by"] = RECOMMEND_BY
    report["labels"] = {"label": cfg.label, "target": prep.target,
                        "censored_samples_in_file": prep.served.censored if prep.served else 0,
                        "at_cap_test_rows": int((y_len >= prep.served.max_tokens).sum())
                        if prep.served and prep.served.max_tokens else 0,
                        "train_examples": len(enc["train"]) if "train" in enc else len(splits.train),
                        "censored_train_rows": int(censored_of(splits.train).sum()),
                        "undecided_left_out_of_eval": prep.undecided or {},
                        "between_samples": _between_samples([*splits.train, *splits.val, *test]) if prep.served else None}
    # top-level keys the CLI contract promises
    for k in ("accuracy", "accuracy_within_1", "mae_tokens", "bias_tokens", "kendall_tau", "under_prediction_rate", "ece"):
        report[k] = report["model"][k]
    plots = work / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    truth = scheme.assign(y_len)
    confusion_png(truth, batch.buckets, scheme, plots / "confusion_matrix.png")
    reliability_png(batch.probs, truth, plots / "reliability.png", report["model"]["ece"])
    error_by_prompt_length_png(rows["test"].prompt_len, errors, plots / "error_by_prompt_length.png")
    return report


def _between_samples(examples: list[Example]) -> dict[str, dict | None]:
    """:func:`training.evaluate.between_samples` over every labelled prompt (a property of the labels, not of a split),
    and per slice."""
    from training.evaluate import between_samples

    return {"all": between_samples(examples), "first_turn": between_samples([e for e in examples if e.first_turn]),
            "later_turns": between_samples([e for e in examples if not e.first_turn])}


def config_from_params(params: dict[str, str]) -> TrainConfig:
    """Rebuild the :class:`TrainConfig` of a logged run from its MLflow params (all strings)."""
    kwargs: dict[str, object] = {}
    for name, field in TrainConfig.model_fields.items():
        if name not in params:
            continue
        raw = params[name]
        kind = _param_kind(field.annotation)
        if raw == "None":
            kwargs[name] = None
        elif kind is bool:
            kwargs[name] = raw == "True"
        elif kind is int:
            kwargs[name] = int(raw)
        elif kind is float:
            kwargs[name] = float(raw)
        elif kind is list:
            kwargs[name] = [x.strip(" '\"") for x in raw.strip("[]").split(",") if x.strip()]
        else:
            kwargs[name] = raw
    return TrainConfig(**kwargs)


def _param_kind(annotation: object) -> type:
    """bool, int, float, list or str: how a field's logged string reads back (``X | None`` as ``X``)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = args[0]
    origin = typing.get_origin(annotation) or annotation
    return origin if origin in (bool, int, float, list) else str
