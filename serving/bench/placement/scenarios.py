"""The fleets and traces the placement benchmark runs: each a single-instance scenario plus fleet settings.

* ``sharegpt``: Aladdin's own setting (§6): a Llama-2-13B-shaped model (OPT-13B has the same 40 layers,
  hidden 5120 and full multi-head KV) on A100-80GB, KV = 90% of 80 GB minus 26 GB of weights, ShareGPT
  first turns with Poisson arrivals, roofline step latency.
* ``sharegpt-kv12``: EcoServe's own setting (§4), the same model with only 12 GB of KV cache: memory,
  not compute, binds, so where KV-aware placement should matter most.
* ``azure-code``: the Azure 2023 code trace (real arrival gaps, rescaled to the rate) on Llama-3.1-8B /
  A100 with BLIS coefficients: long prompts, short answers.
* ``mooncake``: the Mooncake conversation trace on Llama-3.1-8B / H100: very long prompts.
* ``sharegpt-decode``, ``mooncake-decode``, ``mooncake-synthetic-decode`` (Mooncake's second trace): the
  same fleets as a disaggregated decode pool, Aladdin's own measure (its 60% fewer GPUs than JSQ are
  decode GPUs): prompts are prefilled elsewhere, so a decode step never carries prompt compute
  (:class:`DecodePoolLatency`). The SLOs stay those of the colocated fleet (derived with prefill priced);
  TTFT counts only the decode pool's part (queueing, KV arriving, first step), as the prefill pool is not
  simulated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from serving.perf.latency import DecodePoolLatency
from serving.sim.scenarios import SCENARIOS, Scenario, Setup, build_setup, data_path


@dataclass(frozen=True)
class PlacementScenario:
    name: str
    description: str
    base: str                 # the single-instance scenario it starts from
    hardware: dict            # Scenario fields replaced
    max_requests: int
    decode_pool: bool = False  # instances only decode: prompt compute is priced at zero (DecodePoolLatency)


PLACEMENT_SCENARIOS: dict[str, PlacementScenario] = {
    s.name: s for s in (
        PlacementScenario("sharegpt", "Llama-2-13B-shaped model on A100-80GB (46 GB KV), ShareGPT first turns, Poisson "
                                      "arrivals (Aladdin's setting)", "ecoserve-paper",
                          {"kv_bytes": 0.9 * 80e9 - 26e9, "block_size": 16, "max_model_len": 4096}, 3000),
        PlacementScenario("sharegpt-kv12", "EcoServe's setting: OPT-13B on A100-80GB with 12 GB of KV cache (KV-bound), ShareGPT "
                                           "first turns, Poisson arrivals", "ecoserve-paper", {}, 3000),
        PlacementScenario("azure-code", "Azure 2023 code trace (real gaps, rescaled) on Llama-3.1-8B / A100, BLIS step model",
                          "llama8b-a100", {"workload": "traces/AzureLLMInferenceTrace_code_2023.csv", "arrival": "trace"}, 3000),
        PlacementScenario("mooncake", "Mooncake conversation trace (real gaps, rescaled) on Llama-3.1-8B / H100: 13.7k-token "
                                      "prompts on average", "long-context", {}, 1000),
        PlacementScenario("sharegpt-decode", "sharegpt's fleet as a disaggregated decode pool (prefill elsewhere; Aladdin "
                                             "counts decode GPUs)", "ecoserve-paper",
                          {"kv_bytes": 0.9 * 80e9 - 26e9, "block_size": 16, "max_model_len": 4096}, 3000, decode_pool=True),
        PlacementScenario("mooncake-decode", "mooncake's fleet as a disaggregated decode pool (prefill elsewhere)",
                          "long-context", {}, 1000, decode_pool=True),
        PlacementScenario("mooncake-synthetic-decode", "Mooncake's synthetic trace (prompts from public long-document "
                                                       "datasets, 15k tokens on average, short answers, Poisson arrivals) "
                                                       "on mooncake's fleet as a decode pool",
                          "long-context", {"workload": "traces/mooncake_synthetic_trace.jsonl"}, 3993, decode_pool=True),
    )
}


def build_placement_setup(name: str, *, max_requests: int | None = None, predictor: str | None = None, seed: int = 0) -> Setup:
    if name not in PLACEMENT_SCENARIOS:
        raise ValueError(f"unknown placement scenario {name!r}; choose one of: {', '.join(PLACEMENT_SCENARIOS)}")
    ps = PLACEMENT_SCENARIOS[name]
    hw = dict(ps.hardware)
    workload = hw.pop("workload", None)
    arrival = hw.pop("arrival", None)
    base: Scenario = SCENARIOS[ps.base]

    setup = build_setup(base, workload=str(data_path(workload)) if workload else None, arrival=arrival, predictor=predictor,
                        max_requests=max_requests or ps.max_requests, seed=seed, **hw)
    if ps.decode_pool:  # the SLO stays the colocated one, derived above with prefill priced
        setup = replace(setup, latency=DecodePoolLatency(setup.latency),
                        scenario=replace(setup.scenario, description=ps.description))
    return setup
