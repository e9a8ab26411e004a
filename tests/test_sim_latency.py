"""Hardware registry and step-latency models: published anchors, physics sanity, CSV fitting and errors."""

from __future__ import annotations

import csv
import itertools

import numpy as np
import pytest

from serving.perf.hardware import (
    GPUS,
    MODELS,
    GiB,
    HardwareError,
    get_gpu,
    get_model,
    kv_blocks,
    kv_bytes_available,
    kv_capacity_tokens,
)
from serving.perf.latency import (
    BLIS_COEFFS,
    DEFAULT_OVERHEAD_S,
    DecodePoolLatency,
    FittedLatency,
    LatencyError,
    LinearLatency,
    RooflineLatency,
    StepShape,
    isolated_latency,
    make_latency_model,
)

pytestmark = pytest.mark.unit

OPT = get_model("opt-13b")
A100 = get_gpu("a100-80gb")


# ---------- hardware ----------

def test_opt13b_kv_capacity_matches_anchors():
    assert OPT.kv_bytes_per_token() == 2 * 40 * 5120 * 2 == 819_200
    # EcoServe §2.1: "12 GB KV = 14,624 tokens" = 12e9 bytes in whole blocks of 32.
    assert kv_blocks(OPT, 12e9, 32) == 457
    assert kv_capacity_tokens(OPT, 12e9, block_size=32) == 14_624
    assert kv_capacity_tokens(OPT, 12e9) == 14_648
    assert kv_capacity_tokens(OPT, 12 * GiB, block_size=32) == 15_712  # the GiB reading does not match


def test_registry_shapes_agree_with_parameter_counts():
    for m in MODELS.values():
        assert m.param_estimate() == pytest.approx(m.params, rel=0.02), m.name
    assert get_model("llama-3.1-8b").kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2
    assert get_model("smollm2-135m").kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2
    assert OPT.weight_bytes() == pytest.approx(25.8e9)
    assert OPT.flops_per_token() == pytest.approx(2 * 12.9e9)


def test_kv_bytes_available_reproduces_blis_block_counts_at_tp1():
    published = {("llama-3.1-8b", "h100"): 29205, ("llama-3.1-8b", "a100-80gb"): 29205,
                 ("qwen2.5-7b", "a100-80gb"): 67659, ("phi-4", "h100"): 14645}
    for (m, g), blocks in published.items():
        got = kv_blocks(get_model(m), kv_bytes_available(get_model(m), get_gpu(g)), 16)
        assert got == pytest.approx(blocks, rel=0.002), (m, g)
    with pytest.raises(HardwareError, match="no KV memory"):
        kv_bytes_available(get_model("llama-3.3-70b"), get_gpu("a100"))


def test_lookup_aliases_and_unknown_names():
    assert get_model("meta-llama/Llama-3.1-8B-Instruct").name == "llama-3.1-8b"
    assert get_model("HuggingFaceTB/SmolLM2-135M-Instruct").name == "smollm2-135m"
    assert get_gpu("A100").name == "a100-80gb" and get_gpu("H100-SXM").name == "h100"
    with pytest.raises(HardwareError, match=r"unknown model 'gpt-5'.*opt-13b"):
        get_model("gpt-5")
    with pytest.raises(HardwareError, match=r"unknown GPU 'v100'.*h100"):
        get_gpu("v100")
    assert isinstance(HardwareError("x"), ValueError)
    assert set(GPUS) >= {"a100-80gb", "h100", "h200"}
    with pytest.raises(ValueError):  # frozen pydantic model
        OPT.n_layers = 1  # type: ignore[misc]


# ---------- step shapes and linear/BLIS ----------

def test_stepshape_of_derives_sums_and_rejects_negatives():
    s = StepShape.of(prefill_chunks=[(0, 100), (256, 64)], decode_contexts=[10, 20, 30])
    assert (s.prefill_tokens, s.decode_tokens, s.kv_read_tokens, s.num_seqs) == (164, 3, 100 + 320 + 60, 5)
    assert s.prefill_attn_tokens2 == pytest.approx(100 * 50 + 64 * (256 + 32))
    with pytest.raises(LatencyError, match="decode_tokens"):
        StepShape(0, -1, 0, 0)


@pytest.mark.parametrize("key", list(BLIS_COEFFS))
def test_blis_reproduces_table(key):
    model, gpu, tp = key
    b0, b1, b2 = BLIS_COEFFS[key]
    lat = LinearLatency.blis(model, gpu, tp=tp, kv_read=False)
    assert lat.step_time(StepShape(0, 1, 500, 1)) == pytest.approx((b0 + b2) * 1e-6)
    assert lat.step_time(StepShape(512, 7, 9000, 8)) == pytest.approx((b0 + 512 * b1 + 7 * b2) * 1e-6)


def test_blis_anchor_values_and_kv_term():
    plain = LinearLatency.blis("llama-3.1-8b", "a100-80gb", kv_read=False)
    assert plain.describe()["b0_us"] == 16441.532 and plain.describe()["b1_us"] == 47.837
    assert plain.step_time(StepShape(0, 1, 0, 1)) == pytest.approx(16.46e-3, abs=0.01e-3)  # decode batch of 1
    kv = LinearLatency.blis("llama-3.1-8b", "a100-80gb")
    b3 = kv.describe()["b3_us"]
    assert b3 == pytest.approx(131072 / (2.0e12 * 0.8) * 1e6)  # ≈0.082 µs per KV token
    # 64 requests at 8k context: the BLIS fit alone ignores ~43 ms of KV reads.
    s = StepShape(0, 64, 64 * 8192, 64)
    assert kv.step_time(s) - plain.step_time(s) == pytest.approx(64 * 8192 * b3 * 1e-6)
    assert LinearLatency.blis("llama-3.1-8b", "h100", tp=2).describe()["b3_us"] == pytest.approx(
        LinearLatency.blis("llama-3.1-8b", "h100").describe()["b3_us"] / 2)
    with pytest.raises(LatencyError, match=r"no BLIS coefficients for opt-13b.*llama-3.1-8b on h100"):
        LinearLatency.blis("opt-13b", "a100")
    with pytest.raises(LatencyError, match="non-negative"):
        LinearLatency(1.0, -2.0, 1.0)


# ---------- roofline ----------

def test_roofline_opt13b_sanity_numbers():
    r = RooflineLatency(OPT, A100)
    dec = StepShape.of(decode_contexts=[0])
    b = r.breakdown(dec)
    assert b["bound"] == "memory"
    assert b["memory_s"] == pytest.approx(25.8e9 / (2.0e12 * 0.8), rel=0.01)  # ≈16 ms
    assert r.step_time(dec) == pytest.approx(b["memory_s"] + DEFAULT_OVERHEAD_S)
    pre = StepShape.of(prefill_chunks=[(0, 2048)])
    b = r.breakdown(pre)
    assert b["bound"] == "compute"
    dense = 2 * 12.9e9 * 2048 / (312e12 * 0.6)  # the dense FLOPs at 60% of A100's peak: ≈0.28 s
    assert dense < b["compute_s"] < dense * 1.05  # plus attention's quadratic term (~3%)


def test_roofline_tp_and_long_context_decode():
    r1 = RooflineLatency(OPT, A100)
    r2 = RooflineLatency(OPT, A100, tp=2)
    s = StepShape.of(decode_contexts=[1000] * 32)
    assert r2.breakdown(s)["memory_s"] == pytest.approx(r1.breakdown(s)["memory_s"] / 2)
    # A big decode batch at long context is dominated by KV reads, not weights.
    long = StepShape.of(decode_contexts=[2000] * 64)
    assert r1.breakdown(long)["memory_s"] > 2 * r1.breakdown(StepShape.of(decode_contexts=[0]))["memory_s"]


def test_a_tp_cost_is_paid_once_a_step_and_only_with_tp():
    one = RooflineLatency(get_model("llama-13b"), A100, tp=1, tp_overhead_s=0.01)
    two = RooflineLatency(get_model("llama-13b"), A100, tp=2, tp_overhead_s=0.01)
    s = StepShape.of(decode_contexts=[500] * 8)
    assert one.step_time(s) == pytest.approx(RooflineLatency(get_model("llama-13b"), A100).step_time(s))
    assert two.step_time(s) == pytest.approx(max(two.parts(s)) + DEFAULT_OVERHEAD_S + 0.01)
    with pytest.raises(LatencyError, match="tp_overhead_s"):
        RooflineLatency(OPT, A100, tp_overhead_s=-1)


def _shapes():
    for p, d, kv in itertools.product((0, 1, 128, 2048), (0, 1, 32, 256), (0, 100, 10_000, 500_000)):
        if p + d:
            yield StepShape(p, d, kv, d + (1 if p else 0), p * (p / 2))


@pytest.mark.parametrize("lat", [
    RooflineLatency(OPT, A100),
    RooflineLatency(get_model("smollm2-135m"), get_gpu("h200")),
    LinearLatency.blis("llama-3.1-8b", "h100"),
    FittedLatency(0.01, 1e-4, 2e-5, 1e-8),
    DecodePoolLatency(LinearLatency.blis("llama-3.1-8b", "h100")),
    RooflineLatency(get_model("llama-13b"), A100, tp=2, tp_overhead_s=0.01),
], ids=lambda m: m.name)
def test_more_work_is_never_faster(lat):
    shapes = list(_shapes())
    for a in shapes:
        assert lat.step_time(a) > 0
        for bigger in (StepShape(a.prefill_tokens + 64, a.decode_tokens, a.kv_read_tokens + 64, a.num_seqs + 1,
                                 a.prefill_attn_tokens2 + 64 * 32),
                       StepShape(a.prefill_tokens, a.decode_tokens + 1, a.kv_read_tokens + 500, a.num_seqs + 1,
                                 a.prefill_attn_tokens2),
                       StepShape(a.prefill_tokens, a.decode_tokens, a.kv_read_tokens + 10_000, a.num_seqs,
                                 a.prefill_attn_tokens2)):
            assert lat.step_time(bigger) >= lat.step_time(a)
    assert lat.step_time(StepShape(0, 0, 0, 0)) > 0  # never zero: the simulated clock must advance


@pytest.mark.parametrize("base", [RooflineLatency(OPT, A100), LinearLatency.blis("llama-3.1-8b", "h100")], ids=lambda m: m.name)
def test_a_decode_pool_instance_pays_for_its_decodes_not_for_prompts(base):
    """Prefill runs elsewhere: a step with a prompt chunk costs what the same step's decodes cost alone."""
    lat = DecodePoolLatency(base)
    decode_only = StepShape(0, 12, 30_000, 12)
    assert lat.step_time(decode_only) == base.step_time(decode_only)
    with_chunk = StepShape.of(prefill_chunks=[(0, 2048)], decode_contexts=[2500] * 12)
    assert base.step_time(with_chunk) > 2 * base.step_time(decode_only)  # colocated: the chunk dominates the step
    assert lat.step_time(with_chunk) == pytest.approx(base.step_time(StepShape(0, 12, with_chunk.kv_read_tokens, 13)))
    assert lat.describe()["base"] == base.describe()


# ---------- fitted ----------

def _write_profile(path, rows, header=("prefill_tokens", "decode_tokens", "kv_read_tokens", "num_seqs", "step_s", "note")):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def test_fitted_recovers_known_coefficients(tmp_path):
    rng = np.random.default_rng(0)
    true = np.array([0.020, 3e-4, 5e-5, 2e-7])
    rows = []
    for _ in range(300):
        p = int(rng.choice([0, 0, 0, rng.integers(1, 2048)]))
        d = int(rng.integers(0, 128))
        kv = int(d * rng.integers(1, 2000) + p)
        y = true @ [1, p, d, kv] * (1 + rng.normal(0, 0.01))
        rows.append((p, d, kv, d + (p > 0), f"{y:.6f}", "x"))
    fit = FittedLatency.from_csv(_write_profile(tmp_path / "profile.csv", rows))
    np.testing.assert_allclose([fit.c0, fit.c1, fit.c2, fit.c3], true, rtol=0.1)
    d = fit.describe()
    assert d["kind"] == "fitted" and d["n_rows"] == 300 and d["r2"] > 0.99 and d["mape"] < 0.02
    assert d["source"].endswith("profile.csv")
    # Through the spec string too.
    again = make_latency_model(f"fitted:{tmp_path / 'profile.csv'}")
    assert again.step_time(StepShape(100, 10, 5000, 11)) == pytest.approx(fit.step_time(StepShape(100, 10, 5000, 11)))


def test_fitted_never_negative(tmp_path):
    # Step time falls with decode count in this (nonsense) profile: NNLS clamps that coefficient at 0.
    rows = [(p, d, 0, 1, 0.01 + 1e-4 * p - 1e-5 * d) for p, d in [(0, 0), (100, 10), (200, 300), (300, 5), (50, 600)]]
    fit = FittedLatency.from_csv(_write_profile(tmp_path / "neg.csv", rows, header=(
        "prefill_tokens", "decode_tokens", "kv_read_tokens", "num_seqs", "step_s")))
    assert min(fit.c0, fit.c1, fit.c2, fit.c3) >= 0 and fit.c2 == 0


@pytest.mark.parametrize("content, message", [
    ("prefill_tokens,decode_tokens,step_s\n1,2,0.1\n", r"missing column\(s\) kv_read_tokens"),
    ("prefill_tokens,decode_tokens,kv_read_tokens,step_s\n1,2,3,0.1\n2,2,3,0.1\n", r"2 data row\(s\); need at least 4"),
    ("prefill_tokens,decode_tokens,kv_read_tokens,step_s\n1,2,3,0.1\n1,x,3,0.1\n1,2,3,0.1\n1,2,3,0.1\n",
     "line 3 has a non-numeric"),
    ("prefill_tokens,decode_tokens,kv_read_tokens,step_s\n1,2,3,0.1\n1,2,3,-0.1\n1,2,3,0.1\n1,2,3,0.1\n",
     "line 3 has a negative"),
    ("", "missing column"),
])
def test_bad_csv_messages(tmp_path, content, message):
    p = tmp_path / "bad.csv"
    p.write_text(content)
    with pytest.raises(LatencyError, match=message) as e:
        FittedLatency.from_csv(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_missing_csv(tmp_path):
    with pytest.raises(LatencyError, match="cannot read the profile CSV"):
        make_latency_model(f"fitted:{tmp_path / 'nope.csv'}")


# ---------- spec strings and isolated latency ----------

def test_make_latency_model_forms():
    r = make_latency_model("roofline", model="facebook/opt-13b", gpu="A100")
    assert isinstance(r, RooflineLatency) and r.describe()["overhead_s"] == DEFAULT_OVERHEAD_S
    r = make_latency_model("roofline:overhead_ms=0,mfu=0.5,tp=2", model="opt-13b", gpu="a100-80gb")
    assert r.describe()["mfu"] == 0.5 and r.describe()["tp"] == 2 and r.overhead_s == 0
    b = make_latency_model("blis", model="llama-3.1-8b", gpu="h100")
    assert isinstance(b, LinearLatency) and b.b3_us > 0
    assert make_latency_model("blis:kv_read=0", model="llama-3.1-8b", gpu="h100").b3_us == 0  # type: ignore[attr-defined]
    lin = make_latency_model("linear:1000,50,20")
    assert lin.step_time(StepShape(10, 2, 0, 3)) == pytest.approx((1000 + 500 + 40) * 1e-6)
    assert make_latency_model("linear:1000,50,20,0.5").describe()["b3_us"] == 0.5


@pytest.mark.parametrize("spec, kwargs, message", [
    ("roofline", {}, "needs a model and a GPU"),
    ("roofline", {"model": "opt-13b", "gpu": "tpu"}, "unknown GPU 'tpu'"),
    ("roofline:mfu=2", {"model": "opt-13b", "gpu": "a100"}, r"mfu/mbu.*\(0, 1\]"),
    ("roofline:speed=9", {"model": "opt-13b", "gpu": "a100"}, "bad option 'speed=9'"),
    ("blis", {"model": "opt-13b", "gpu": "a100"}, "no BLIS coefficients"),
    ("linear:1,2", {}, r"linear:b0,b1,b2\[,b3\]"),
    ("linear:a,b,c", {}, r"linear:b0,b1,b2\[,b3\]"),
    ("fitted:", {}, "fitted:PATH.csv"),
    ("vidur", {}, "unknown latency model 'vidur'"),
])
def test_make_latency_model_errors(spec, kwargs, message):
    with pytest.raises(LatencyError, match=message):
        make_latency_model(spec, **kwargs)


def test_isolated_latency():
    lin = LinearLatency(10_000, 50, 20, 0.1)
    t_p, t_g = isolated_latency(lin, 1000, 100)
    assert t_p == pytest.approx((10_000 + 50 * 1000 + 0.1 * 1000) * 1e-6)
    assert t_g == pytest.approx((10_000 + 20 + 0.1 * (1000 + 49.5)) * 1e-6)  # mean context = prompt + (RL-1)/2
    _, long_g = isolated_latency(lin, 1000, 5000)  # sampled contexts: still exact for a linear model
    assert long_g == pytest.approx((10_000 + 20 + 0.1 * (1000 + 2499.5)) * 1e-6, rel=1e-6)
    r = RooflineLatency(OPT, A100)
    t_p, t_g = isolated_latency(r, 2048, 1)
    assert t_p == pytest.approx(r.step_time(StepShape.of(prefill_chunks=[(0, 2048)])))
    assert 0.016 < t_g < 0.020 and t_p > 10 * t_g
    with pytest.raises(LatencyError, match="prompt_tokens >= 1"):
        isolated_latency(r, 0, 10)
