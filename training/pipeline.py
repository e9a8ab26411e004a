"""The whole predictor job: data → labels → split → train (Lightning) → evaluate vs baselines →
ONNX export + parity → MLflow logging → registration and aliases. The CLI and the benchmark call this."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from predictor.buckets import BucketScheme
from predictor.common import default_tokenizer
from training.data import Example, load_examples
from training.data.labels import TokenCounter, attach_labels, labels_of, load_counter
from training.split import Splits, cap_groups, split_by_group

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    data: str
    fmt: str = "sharegpt"
    tokenizer: str | None = None
    generator: str | None = None
    first_turn_only: bool = False
    bucket_width: int | None = 200
    edges: str | None = None
    max_tokens: int = 2048
    base_model: str | None = None
    max_samples: int | None = 20000
    epochs: int = 4
    lr: float = 2e-3
    batch_size: int = 32
    max_prompt_tokens: int = 128
    length_hints: bool = True
    lora_rank: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.1
    lora_targets: list[str] | None = None
    patience: int = 2
    seed: int = 0
    padding: float = 0.15
    quantile: float = 0.9
    experiment: str = "length-predictor"
    register: str | None = "length-predictor"
    alias: str | None = "challenger"
    promote: bool = False
    force: bool = False
    output_json: str | None = None
    work_dir: str | None = None
    baselines: bool = True


@dataclass
class Prepared:
    splits: Splits
    scheme: BucketScheme
    counter: TokenCounter  # the target model's tokenizer, also used for prompt lengths in evaluation


def prepare(cfg: TrainConfig) -> Prepared:
    """Load, label, cap and split the data, and fix the bucket scheme (centers from training labels)."""
    scheme = (BucketScheme.parse(cfg.edges, cfg.max_tokens) if cfg.edges
              else BucketScheme.equal_width(200 if cfg.bucket_width is None else int(cfg.bucket_width), cfg.max_tokens))
    counter = load_counter(cfg.tokenizer or default_tokenizer())
    kwargs = {"generator": cfg.generator, "first_turn_only": cfg.first_turn_only}
    examples = cap_groups(load_examples(cfg.data, cfg.fmt, **kwargs), cfg.max_samples, cfg.seed)
    attach_labels(examples, counter)
    splits = split_by_group(examples, seed=cfg.seed)
    if not splits.train or not splits.val or not splits.test:
        from training.data import DataError

        raise DataError(f"too few conversations to split ({len(examples)} examples): need data for train, val and test")
    scheme = scheme.with_centers(labels_of(splits.train))
    return Prepared(splits, scheme, counter)


def _turns(e: Example) -> list[tuple[str, str]]:
    return [(t.role, t.text) for t in e.turns]


def run(cfg: TrainConfig) -> dict:
    """Run the job; returns the report dict that ``--output-json`` writes."""
    import lightning as L
    import mlflow
    import torch
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import MLFlowLogger

    from predictor.common import silence_loggers
    from predictor.model import LoraSpec, build_classifier, default_backbone_path, default_targets
    from predictor.prompt import encode_turns
    from predictor.runtime import OnnxLengthPredictor
    from registry import store
    from training.export import export_package, input_format_for, load_backbone_tokenizer, parity_max_abs_diff
    from training.module import LengthModule, make_loader

    silence_loggers()
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    prep = prepare(cfg)
    splits, scheme = prep.splits, prep.scheme
    base = Path(cfg.base_model) if cfg.base_model else default_backbone_path()
    if not (base / "config.json").exists():
        from training.data import DataError

        raise DataError(f"--base-model {base} is not a Hugging Face model directory (no config.json)")
    tok = load_backbone_tokenizer(base)
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(base, local_files_only=True).model_type
    fmt_in = input_format_for(tok, cfg.max_prompt_tokens, None, cfg.length_hints)
    enc = {name: encode_turns(tok, fmt_in, [_turns(e) for e in part])
           for name, part in (("train", splits.train), ("val", splits.val), ("test", splits.test))}
    y = {name: scheme.assign(labels_of(part)) for name, part in
         (("train", splits.train), ("val", splits.val), ("test", splits.test))}

    lora = LoraSpec(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets or default_targets(model_type))
    model = build_classifier(base, scheme.n, lora)
    module = LengthModule(model, scheme.centers, lr=cfg.lr)
    train_dl = make_loader([e.ids for e in enc["train"]], y["train"].tolist(), fmt_in.pad_id, cfg.batch_size, True, cfg.seed)
    val_dl = make_loader([e.ids for e in enc["val"]], y["val"].tolist(), fmt_in.pad_id, 64, False, cfg.seed)

    exp_id = store.ensure_experiment(cfg.experiment)
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="lengthwise-train-"))
    work.mkdir(parents=True, exist_ok=True)
    params = dict(asdict(cfg))
    params.update(base_model=str(base), model_type=model_type, n_buckets=scheme.n,
                  n_train=len(splits.train), n_val=len(splits.val), n_test=len(splits.test),
                  lora_targets=",".join(lora.target_modules), eval_split=splits.fingerprint(),
                  label_tokenizer=str(cfg.tokenizer or default_tokenizer()))
    with mlflow.start_run(experiment_id=exp_id) as run_:
        mlflow.log_params({k: str(v)[:500] for k, v in params.items()})
        logger = MLFlowLogger(experiment_name=cfg.experiment, tracking_uri=store.tracking_uri(), run_id=run_.info.run_id)
        ckpt = ModelCheckpoint(dirpath=work / "ckpt", monitor="val_acc", mode="max", save_top_k=1, save_weights_only=True)
        trainer = L.Trainer(
            max_epochs=cfg.epochs, accelerator="cpu", devices=1, logger=logger, deterministic=False,
            callbacks=[EarlyStopping(monitor="val_acc", mode="max", patience=cfg.patience), ckpt],
            enable_progress_bar=True, log_every_n_steps=20, num_sanity_val_steps=0, enable_model_summary=False,
        )
        t_train = time.perf_counter()
        trainer.fit(module, train_dl, val_dl)
        train_seconds = time.perf_counter() - t_train
        epoch_times = [float(v) for v in _metric_history(run_.info.run_id, "epoch_time_s")]
        if ckpt.best_model_path:
            state = torch.load(ckpt.best_model_path, map_location="cpu", weights_only=False)["state_dict"]
            module.load_state_dict(state)
        model = module.model.eval()

        package = export_package(model, work / "package", base, scheme, fmt_in, {
            "backbone": str(base.name), "model_type": model_type, "label_tokenizer": Path(str(cfg.tokenizer or default_tokenizer())).name,
            "trained_on": str(cfg.data), "format": cfg.fmt, "generator": cfg.generator, "eval_split": splits.fingerprint(),
        })
        onnx_pred = OnnxLengthPredictor(package)
        test_ids = [e.ids for e in enc["test"]]
        parity_ids = test_ids[:: max(1, len(test_ids) // 256)][:256]
        parity = parity_max_abs_diff(model, onnx_pred, parity_ids)
        report = evaluate_all(cfg, prep, onnx_pred, enc, work)
        report.update(
            onnx_parity_max_abs_diff=parity, train_seconds=train_seconds, epoch_seconds=epoch_times,
            epochs_run=int(trainer.current_epoch), best_epoch_val_acc=float(ckpt.best_model_score or float("nan")),
            n_train=len(splits.train), n_val=len(splits.val), n_test=len(splits.test), eval_split=splits.fingerprint(),
            buckets=scheme.to_dict(), base_model=str(base), run_id=run_.info.run_id, tracking_uri=store.tracking_uri(),
        )
        mlflow.log_metrics({f"test_{k}": v for k, v in report["model"].items() if isinstance(v, (int, float))})
        mlflow.log_metric("onnx_parity_max_abs_diff", parity)
        mlflow.log_metric("train_seconds", train_seconds)
        for b, m in report["baselines"].items():
            mlflow.log_metrics({f"baseline_{b}_{k}": v for k, v in m.items() if isinstance(v, (int, float))})
        mlflow.log_artifacts(str(work / "plots"), "plots")
        report["model_uri"] = f"runs:/{run_.info.run_id}/length_predictor"
        if cfg.register:
            reg = store.register_package(package, cfg.register, report["model"], splits.fingerprint(), list(scheme.edges))
            report.update(model_uri=reg.model_uri, registered_name=reg.name, registered_version=reg.version)
            if cfg.alias:
                store.set_alias(reg.name, cfg.alias, reg.version)
                report["alias"] = cfg.alias
            if cfg.promote:
                try:
                    report["promotion"] = store.promote(reg.name, reg.version, store.CHAMPION, cfg.force)
                except store.PromotionRefused as exc:
                    report["promotion"] = f"refused: {exc}"
        if parity >= 1e-3:
            log.error("ONNX parity check failed: max |logit diff| %.2e >= 1e-3", parity)
        report["total_seconds"] = time.perf_counter() - t0
        (work / "metrics.json").write_text(json.dumps(report, indent=2, default=float))
        mlflow.log_artifact(str(work / "metrics.json"))
    if cfg.output_json:
        Path(cfg.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.output_json).write_text(json.dumps(report, indent=2, default=float))
    return report


def _metric_history(run_id: str, key: str) -> list[float]:
    from mlflow import MlflowClient

    return [m.value for m in sorted(MlflowClient().get_metric_history(run_id, key), key=lambda m: m.step)]


def evaluate_all(cfg: TrainConfig, prep: Prepared, predictor, enc: dict, work: Path) -> dict:
    """Our model and the baselines on the test split: metrics, accuracy at 100/200/400, plots."""
    from training.baselines import BASELINES
    from training.evaluate import Predictions, accuracy_at_widths, compute_metrics
    from training.plots import confusion_png, error_by_prompt_length_png, reliability_png

    splits, scheme = prep.splits, prep.scheme
    test = splits.test
    y_len = labels_of(test).astype(np.float64)
    batch = predictor.predict_encoded(enc["test"], cfg.quantile)
    ours = Predictions(batch.probs, batch.expected)
    report = {"model": compute_metrics(ours, y_len, scheme, cfg.padding)}
    report["model"]["quantile"] = cfg.quantile
    report["model"]["under_prediction_rate_at_quantile"] = float((y_len > batch.quantile).mean())
    report["model"]["truncated_prompts"] = float(batch.truncated.mean())
    report["accuracy_at_widths"] = {"lengthwise": accuracy_at_widths(ours, scheme, y_len)}
    # full (untruncated) prompt length in target-model tokens: what Aladdin's predictor conditions on
    prompt_len = {k: prep.counter.count(["\n".join(t.text for t in e.turns) for e in part])
                  for k, part in (("train", splits.train), ("test", test))}
    texts = {k: [" \n".join(t.text[-4000:] for t in e.turns[-3:]) for e in part]
             for k, part in (("train", splits.train), ("test", test))}
    train_len = labels_of(splits.train).astype(np.float64)
    report["baselines"] = {}
    errors = {"lengthwise": ours.point - y_len}
    if cfg.baselines:
        for cls in BASELINES:
            b = cls().fit(train_len, scheme, prompt_len=prompt_len["train"], texts=texts["train"])
            p = b.predict(len(test), prompt_len=prompt_len["test"], texts=texts["test"])
            report["baselines"][b.name] = compute_metrics(p, y_len, scheme, cfg.padding)
            report["accuracy_at_widths"][b.name] = accuracy_at_widths(p, scheme, y_len)
            errors[b.name] = p.point - y_len
    # top-level keys the CLI contract promises
    for k in ("accuracy", "accuracy_within_1", "mae_tokens", "bias_tokens", "kendall_tau", "under_prediction_rate", "ece"):
        report[k] = report["model"][k]
    plots = work / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    truth = scheme.assign(y_len)
    confusion_png(truth, batch.buckets, scheme, plots / "confusion_matrix.png")
    reliability_png(batch.probs, truth, plots / "reliability.png", report["model"]["ece"])
    error_by_prompt_length_png(prompt_len["test"], errors, plots / "error_by_prompt_length.png")
    return report


def config_from_params(params: dict[str, str]) -> TrainConfig:
    """Rebuild the :class:`TrainConfig` of a logged run from its MLflow params (all strings)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(TrainConfig)
    kwargs = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name not in params:
            continue
        raw = params[f.name]
        hint = str(hints[f.name])
        if raw == "None":
            kwargs[f.name] = None
        elif "bool" in hint:
            kwargs[f.name] = raw == "True"
        elif "int" in hint:
            kwargs[f.name] = int(raw)
        elif "float" in hint:
            kwargs[f.name] = float(raw)
        elif "list" in hint:
            kwargs[f.name] = [x.strip(" '\"") for x in raw.strip("[]").split(",") if x.strip()]
        else:
            kwargs[f.name] = raw
    return TrainConfig(**kwargs)
