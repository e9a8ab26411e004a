"""Named benchmark scenarios and how a workload file becomes a ready-to-run simulation setup.

A scenario fixes the model, accelerator, KV memory, latency model, engine limits and the workload, so
``lengthwise bench sim --scenario NAME`` is reproducible. Settings come from the papers (EcoServe §2.1
and §4 for ``ecoserve-paper``) or from published vLLM defaults, never from what makes a policy win.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from predictor.common import data_dir
from serving.perf.hardware import get_model, kv_blocks
from serving.perf.latency import LatencyModel, StepShape, make_latency_model
from serving.perf.slo import SLO, derive_slo
from serving.policy.config import PolicyConfig
from serving.policy.request import Prediction
from serving.sim.arrivals import parse_arrivals
from serving.sim.predictions import LengthOracle, make_predictor
from serving.sim.refinement import RefinedNoise
from serving.sim.workload import TraceRequest, Workload, load_workload

SHAREGPT = "prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"
ALPACA_EVAL = "prompts/alpaca_eval_model_outputs.62models.jsonl.xz"
# four 7-8B chat models as services of one engine, their mean answers 82 to 443 GPT-2 tokens on AlpacaEval's prompts
SEALLM_SERVICES = "alpaca-7b_concise,vicuna-7b,llama-2-7b-chat-hf,Meta-Llama-3-8B-Instruct"


EXACT_SUFFIX = "+oracle"  # POLICY+oracle: that policy fed true lengths
REFINED_SUFFIX = "+refined"  # POLICY+refined: that policy, its predictions refined as answers are written


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    workload: str                 # path under $LENGTHWISE_DATA (or absolute)
    arrival: str                  # "poisson" (rate sets the mean) or "trace" (timestamps rescaled to the rate)
    model: str
    gpu: str
    latency: str                  # spec for make_latency_model
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int   # vLLM's default for this GPU and the OpenAI server
    max_num_seqs: int
    start_rate: float
    kv_bytes: float | None = None
    kv_blocks: int | None = None
    tokenizer: str | None = None
    predictor: str = "noise:0.55"  # our trained predictor's top-1 accuracy at 200-token buckets
    max_requests: int = 1500
    policy_overrides: dict = field(default_factory=dict)
    generator: str | None = None  # AlpacaEval: whose answers (several, comma-separated: one service each)


SCENARIOS: dict[str, Scenario] = {
    s.name: s for s in (
        Scenario(
            name="ecoserve-paper",
            description="EcoServe's own setting: OPT-13B on one A100-80GB, 12 GB of KV cache, block 32, ShareGPT "
                        "first turns (GPT-2 BPE tokens, as OPT uses), Poisson arrivals, roofline step latency",
            workload=SHAREGPT, arrival="poisson", model="opt-13b", gpu="a100-80gb", latency="roofline",
            block_size=32, max_model_len=2048, max_num_batched_tokens=2048, max_num_seqs=256, start_rate=0.5,
            kv_bytes=12e9, tokenizer="tokenizers/gpt2/tokenizer.json"),
        Scenario(
            name="llama8b-a100",
            description="Llama-3.1-8B on A100-80GB: BLIS step coefficients plus a KV-read term, the KV pool BLIS "
                        "measured (29,205 blocks of 16), ShareGPT first turns in Llama-3 tokens, Poisson arrivals",
            workload=SHAREGPT, arrival="poisson", model="llama-3.1-8b", gpu="a100-80gb", latency="blis",
            block_size=16, max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256, start_rate=2.0,
            kv_blocks=29205, tokenizer="tokenizers/llama3/tokenizer.model"),
        Scenario(
            name="long-context",
            description="Mooncake conversation trace (real timestamps, rescaled to each rate) on Llama-3.1-8B/H100: "
                        "BLIS H100 coefficients plus KV reads, 29,205 blocks of 16",
            workload="traces/mooncake_conversation_trace.jsonl", arrival="trace", model="llama-3.1-8b", gpu="h100",
            latency="blis", block_size=16, max_model_len=131072, max_num_batched_tokens=8192, max_num_seqs=1024,
            start_rate=0.25, kv_blocks=29205, max_requests=1000),
        Scenario(
            name="seallm-services",
            description="SeaLLM's setting inside one engine: four services of one size (7-8B chat models as LoRA "
                        "fine-tunes of one base would be) answering AlpacaEval's instructions with their own lengths "
                        f"({SEALLM_SERVICES.replace(',', ', ')}: means 82 to 443 GPT-2 tokens), shuffled together, Poisson "
                        "arrivals; Llama-3.1-8B on an A100 (BLIS), 29,205 blocks of 16; SLO 5x the execution time "
                        "(SeaLLM §5)",
            workload=ALPACA_EVAL, generator=SEALLM_SERVICES, arrival="poisson", model="llama-3.1-8b", gpu="a100-80gb",
            latency="blis", block_size=16, max_model_len=8192, max_num_batched_tokens=2048, max_num_seqs=256,
            start_rate=2.0, kv_blocks=29205, tokenizer="tokenizers/gpt2/tokenizer.json", max_requests=3220,
            # top-1 0.59 at 200-token buckets: TF-IDF fitted per service on these four (bench model-lengths)
            predictor="noise:0.59", policy_overrides={"slo_scale": 5.0}),
    )
}


def data_path(rel: str) -> Path:
    p = Path(rel)
    return p if p.is_absolute() else data_dir() / p


def saturating_forward_size(latency: LatencyModel, limit: int, frac: float = 0.95) -> int:
    """EcoServe's TFS: the smallest power-of-two forward size reaching ``frac`` of the best prefill throughput.

    EcoServe (after FastGen) sets TFS "by finding the forward size that saturates GPU utilization";
    here the latency model plays the GPU.
    """
    sizes = [s for s in (2 ** k for k in range(5, 16)) if s <= limit] or [limit]
    thr = {s: s / latency.step_time(StepShape.of([(0, s)])) for s in sizes}
    best = max(thr.values())
    return next(s for s in sizes if thr[s] >= frac * best)


@dataclass
class Setup:
    """Everything a run needs besides the policy name and the rate."""

    scenario: Scenario
    workload: Workload
    latency: LatencyModel
    kv_blocks: int
    config: PolicyConfig
    slo: SLO
    predictor: LengthOracle
    predictions: list[Prediction]
    seed: int = 0
    arrivals: str = "poisson"  # how at_rate times requests: poisson, gamma:CV or trace-times:TRACE (serving/sim/arrivals.py)
    refinements: RefinedNoise | None = None  # what POLICY+refined gets as its answers are written (sim/refinement.py)
    _oracle: tuple | None = None

    @property
    def requests(self) -> list[TraceRequest]:
        return self.workload.requests

    def native_rate(self) -> float:
        w = self.workload
        return (len(w) - 1) / w.duration if w.duration > 0 else float("nan")

    def at_rate(self, rate: float) -> list[TraceRequest]:
        """The same requests with arrivals for ``rate`` req/s, as ``arrivals`` says (drawn from the setup's seed). Under
        ``poisson``, a scenario whose arrival is ``trace`` keeps the workload's own timestamps, rescaled to the rate;
        ``gamma:CV`` and ``trace-times:TRACE`` replace them too."""
        reqs = self.requests
        process = parse_arrivals(self.arrivals)
        if process.kind == "poisson" and self.scenario.arrival == "trace" and self.workload.has_timestamps:
            k = self.native_rate() / rate
            return [dataclasses.replace(r, arrival=r.arrival * k) for r in reqs]
        times = process.times(len(reqs), rate, self.seed)
        return [dataclasses.replace(r, arrival=float(t)) for r, t in zip(reqs, times)]

    def predictions_for(self, policy: str) -> tuple[list[Prediction], LengthOracle]:
        """``oracle`` runs ecoserve on true lengths, and ``POLICY+oracle`` any policy on them (what the same policy
        reaches with exact lengths, in the same run); every other policy sees the scenario's predictor."""
        name = policy.strip().lower()
        if name != "oracle" and not name.endswith(EXACT_SUFFIX):
            return self.predictions, self.predictor
        if self._oracle is None:
            o = make_predictor("oracle")
            self._oracle = (o.predict(self.requests), o)
        return self._oracle


def build_setup(scenario: Scenario, *, workload: str | None = None, predictor: str | None = None,
                max_requests: int | None = None, latency: str | None = None, seed: int = 0, arrival: str | None = None,
                tokenizer: str | None = None, overrides: dict | None = None, length_noise: float = 0.0,
                arrivals: str = "poisson", **hardware) -> Setup:
    """Load the workload, price it, size the KV pool and derive the SLOs for ``scenario``.

    ``workload``/``arrival``/``tokenizer``/``latency``/``predictor`` and ``hardware`` (any Scenario field, e.g.
    ``model``, ``gpu``, ``kv_blocks``) replace the scenario's; ``overrides`` sets PolicyConfig fields.
    ``length_noise``: SeaLLM's figure 13 (§5), see :func:`perturb_lengths`. ``arrivals``: the arrival process of every
    rate (:mod:`serving.sim.arrivals`), checked before the workload loads.
    """
    arrivals = parse_arrivals(arrivals).spec
    if hardware:
        if "kv_bytes" in hardware and "kv_blocks" not in hardware:
            hardware["kv_blocks"] = None
        scenario = dataclasses.replace(scenario, **hardware)
    if arrival:
        scenario = dataclasses.replace(scenario, arrival=arrival)
    model = get_model(scenario.model)
    lat = make_latency_model(latency or scenario.latency, scenario.model, scenario.gpu)
    tok = tokenizer or (str(data_path(scenario.tokenizer)) if scenario.tokenizer else None)
    w = load_workload(workload or data_path(scenario.workload), arrival=scenario.arrival,
                      rate=None if scenario.arrival == "trace" else scenario.start_rate,
                      max_requests=max_requests or scenario.max_requests, seed=seed,
                      max_prompt_tokens=scenario.max_model_len, tokenizer=tok, generator=scenario.generator)
    if scenario.kv_blocks:
        blocks = scenario.kv_blocks
    elif scenario.kv_bytes:
        blocks = kv_blocks(model, scenario.kv_bytes, scenario.block_size)
    else:
        raise ValueError(f"scenario {scenario.name} sets neither kv_blocks nor kv_bytes")
    tfs = saturating_forward_size(lat, max(scenario.max_num_batched_tokens, 4096))
    cfg = PolicyConfig(**{"block_size": scenario.block_size, "max_num_seqs": scenario.max_num_seqs,
                          "max_num_batched_tokens": scenario.max_num_batched_tokens, "max_model_len": scenario.max_model_len,
                          "tfs": tfs, **scenario.policy_overrides, **(overrides or {})})
    pred = make_predictor(predictor or scenario.predictor, seed=seed)
    predictions = pred.predict(w.requests)  # made before the noise: it is nothing a prompt tells
    if length_noise:
        w = dataclasses.replace(w, requests=perturb_lengths(w.requests, length_noise, scenario.max_model_len, seed))
    slo = derive_slo(lat, [r.prompt_tokens for r in w.requests], [r.output_tokens for r in w.requests], cfg.slo_scale)
    if cfg.ttft_s is None:  # the operator's TTFT target is the SLO's: a policy steered by TTFT reads it from its config
        cfg = cfg.model_copy(update={"ttft_s": slo.ttft_s})
    return Setup(scenario, w, lat, blocks, cfg, slo, pred, predictions, seed, arrivals)


def perturb_lengths(reqs: list[TraceRequest], sigma: float, max_model_len: int, seed: int = 0) -> list[TraceRequest]:
    """SeaLLM's test of profiling accuracy (§5, figure 13): each request's output length moved by a Gaussian delta of
    mean 0 and standard deviation ``sigma`` times that length, kept within [1, the context the prompt leaves]. The
    predictions and the services' profiles describe the lengths before the move, so neither can know it."""
    import numpy as np

    rng = np.random.default_rng(seed + 7919)
    out = []
    for r, z in zip(reqs, rng.standard_normal(len(reqs))):
        n = round(r.output_tokens * (1 + sigma * z))
        out.append(dataclasses.replace(r, output_tokens=int(min(max(n, 1), max_model_len - r.prompt_tokens))))
    return out
