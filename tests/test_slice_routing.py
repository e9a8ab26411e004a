"""Per-slice routing: a package ships the TF-IDF baseline for a slice it wins, and the runtime and the sidecar answer
that slice's prompts with it, row for row as training fitted it, the rest with the ONNX model, in the prompts' order.

Real parts throughout: ShareGPT conversations labelled in GPT-2 tokens, a real (tiny, random-weight) ONNX package,
the baseline fitted by training.baselines and written with skops, a local MLflow store, the sidecar over FastAPI's
TestClient, and two short ``train-predictor`` runs on a tiny backbone.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from predictor.runtime import OnnxLengthPredictor
from predictor.slices import MODEL, TFIDF, SliceModelError, routes_tag, slice_of
from tests.conftest import SHAREGPT
from tests.datafiles import need_data
from training.baselines import TfidfLogReg, rows_of
from training.data import Example, load_examples
from training.data.labels import attach_labels, load_counter
from training.evaluate import Predictions, compute_metrics, recommend, slice_masks, take
from training.routing import fastest_within, served_slice_metrics, ship_routes
from training.split import cap_groups, split_by_group

ROUTED = {"first_turn": TFIDF, "later_turns": MODEL}  # what a report that TF-IDF wins on first turns ships


def _turns(e: Example) -> list[tuple[str, str]]:
    return [(t.role, t.text) for t in e.turns]


def _rows(examples: list[Example]):
    return rows_of(examples, np.zeros(len(examples)))  # prompt lengths: only prompt-length-bin reads them


@pytest.fixture(scope="module")
def splits(data):
    """About 3,000 ShareGPT examples, first and later turns, whole conversations, labelled in GPT-2 tokens; a fifth of
    the conversations each for validation and test (a long conversation holds dozens of rows)."""
    examples = cap_groups(load_examples(need_data(SHAREGPT), "sharegpt"), 3000, seed=0)
    attach_labels(examples, load_counter(need_data("tokenizers/gpt2/tokenizer.json")))
    return split_by_group(examples, val=0.2, test=0.2, seed=0)


@pytest.fixture(scope="module")
def shipped(data, splits, tmp_path_factory):
    """A tiny ONNX package (``plain``: no routes), the TF-IDF baseline fitted on its scheme for first turns (as
    :func:`training.baselines.fit_sliced` fits a slice, with one C to keep it quick), the report blocks of both on the
    test split, and a copy of the package with the first-turn baseline shipped (``routed``)."""
    from tests.tiny_package import tiny_packages

    work = tmp_path_factory.mktemp("routing")
    plain = tiny_packages(work, need_data("tokenizers/gpt2/tokenizer.json"), {"plain": None})["plain"]
    scheme = OnnxLengthPredictor(plain).scheme
    train, val, test = (_rows([e for e in part if e.first_turn]) for part in (splits.train, splits.val, splits.test))
    fitted = {"first_turn": TfidfLogReg(c_grid=(2.0,)).fit(train, val, scheme)}
    tfidf = Predictions(np.zeros((len(splits.test), scheme.n)), np.zeros(len(splits.test)))
    first = np.array([e.first_turn for e in splits.test])
    part = fitted["first_turn"].predict(test)
    tfidf.probs[first], tfidf.point[first] = part.probs, part.point
    ours = OnnxLengthPredictor(plain).predict([_turns(e) for e in splits.test])
    lengths = np.array([e.response_tokens for e in splits.test], dtype=np.float64)
    masks = slice_masks(splits.test)
    preds = {MODEL: Predictions(ours.probs, ours.expected), TFIDF: tfidf}
    blocks = {s: {n: compute_metrics(take(p, m), lengths[m], scheme) for n, p in preds.items()}
              for s, m in masks.items() if s == "first_turn"}
    blocks["later_turns"] = {MODEL: compute_metrics(take(preds[MODEL], ~first), lengths[~first], scheme)}
    report = {"slices": blocks, "recommended": ROUTED, "recommended_by": "pairwise_accuracy"}
    routed = work / "routed"
    shutil.copytree(plain, routed)
    routes = ship_routes(routed, report, {TFIDF: fitted})
    return {"plain": plain, "routed": routed, "fitted": fitted, "report": report, "routes": routes}


def test_the_runtime_knows_a_first_turn_as_training_does(splits):
    examples = splits.train[:600]
    assert any(e.first_turn for e in examples) and not all(e.first_turn for e in examples)
    assert [slice_of(_turns(e)) == "first_turn" for e in examples] == [e.first_turn for e in examples]
    assert slice_of([("system", "be brief"), ("user", "hi")]) == "first_turn"
    assert slice_of([("user", "hi"), ("assistant", "hello"), ("user", "more")]) == "later_turns"


def test_tfidf_outranks_a_random_model_on_first_turns(shipped):
    """The premise of routing, measured: on real first turns the baseline ranks better than an untrained model."""
    assert recommend(shipped["report"]["slices"]["first_turn"]) == TFIDF


def test_routed_first_turns_are_the_baselines_own_predictions(shipped, splits):
    first = [e for e in splits.test if e.first_turn]
    routed = OnnxLengthPredictor(shipped["routed"])
    out = routed.predict([_turns(e) for e in first], quantile=0.8)
    ref = shipped["fitted"]["first_turn"].predict(_rows(first)).probs  # the object training evaluated
    np.testing.assert_array_equal(out.probs, ref)
    np.testing.assert_allclose(out.expected, routed.scheme.expected(ref))
    np.testing.assert_allclose(out.quantile, routed.scheme.quantile(ref, 0.8))
    np.testing.assert_array_equal(out.buckets, ref.argmax(1))
    assert set(out.predictor) == {TFIDF} and not out.truncated.any()


def test_later_turns_are_the_onnx_models(shipped, splits):
    later = [_turns(e) for e in splits.test if not e.first_turn]
    out = OnnxLengthPredictor(shipped["routed"]).predict(later)
    ref = OnnxLengthPredictor(shipped["plain"]).predict(later)
    np.testing.assert_allclose(out.probs, ref.probs, atol=1e-6)
    np.testing.assert_array_equal(out.truncated, ref.truncated)
    assert set(out.predictor) == {MODEL}


def test_a_mixed_batch_comes_back_in_order(shipped, splits):
    convs = [_turns(e) for e in splits.test[:80]]
    assert {slice_of(c) for c in convs} == {"first_turn", "later_turns"}
    routed = OnnxLengthPredictor(shipped["routed"])
    out = routed.predict(convs)
    assert list(out.predictor) == [TFIDF if slice_of(c) == "first_turn" else MODEL for c in convs] == routed.route(convs)
    for i, c in enumerate(convs):
        np.testing.assert_allclose(out.probs[i], routed.predict([c]).probs[0], atol=1e-6)


def test_meta_json_and_the_registry_tag_record_the_routes(shipped, home):
    import mlflow

    from predictor.tracking import ensure_experiment
    from registry import store

    meta = json.loads((shipped["routed"] / "meta.json").read_text())
    routes = meta["routes"]
    assert routes == shipped["routes"] and meta["routes_by"] == "pairwise_accuracy"
    assert {s: r["predictor"] for s, r in routes.items()} == ROUTED
    assert routes["first_turn"]["file"] == "slices/first_turn.skops" and "file" not in routes["later_turns"]
    assert (shipped["routed"] / "slices/first_turn.skops").is_file()
    assert not (shipped["routed"] / "slices/later_turns.skops").exists()
    block = shipped["report"]["slices"]
    assert routes["first_turn"]["test_metrics"] == block["first_turn"][TFIDF]
    assert routes["later_turns"]["test_metrics"] == block["later_turns"][MODEL]
    assert served_slice_metrics(shipped["report"], routes) == {"first_turn": block["first_turn"][TFIDF],
                                                               "later_turns": block["later_turns"][MODEL]}
    with mlflow.start_run(experiment_id=ensure_experiment("tests-routing")):
        routed = store.register_package(shipped["routed"], "routing-test", {}, "split", [0, 64, 256])
        plain = store.register_package(shipped["plain"], "routing-test", {}, "split", [0, 64, 256])
    tags = {v: mlflow.MlflowClient().get_model_version("routing-test", v).tags for v in (routed.version, plain.version)}
    assert tags[routed.version][store.TAG_ROUTES] == "first_turn=tfidf-logreg,later_turns=lengthwise" == routes_tag(routes)
    assert store.TAG_ROUTES not in tags[plain.version]


def test_route_slices_off_ships_nothing(shipped, tmp_path):
    from training.cli import build_parser, config_from_args

    pkg = shutil.copytree(shipped["plain"], tmp_path / "off")
    before = (pkg / "meta.json").read_text()
    assert ship_routes(pkg, shipped["report"], {TFIDF: shipped["fitted"]}, mode="off") is None
    assert (pkg / "meta.json").read_text() == before and not (pkg / "slices").exists()
    assert OnnxLengthPredictor(pkg).routes == {}
    assert config_from_args(build_parser().parse_args(["--data", "x"])).route_slices == "auto"
    assert config_from_args(build_parser().parse_args(["--data", "x", "--route-slices", "off"])).route_slices == "off"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--data", "x", "--route-slices", "sometimes"])
    assert exc.value.code == 2


def _m(top1: float, tau: float) -> dict:
    return {"accuracy": top1, "kendall_tau": tau}


@pytest.mark.parametrize("block, want", [
    ({MODEL: _m(0.461, 0.470), TFIDF: _m(0.452, 0.455)}, TFIDF),          # within 1 point and 0.02: the cheaper serves
    ({MODEL: _m(0.461, 0.470), TFIDF: _m(0.449, 0.470)}, MODEL),          # 1.2 points of top-1 lost: too much
    ({MODEL: _m(0.461, 0.470), TFIDF: _m(0.461, 0.449)}, MODEL),          # 0.021 of tau lost: too much
    ({MODEL: _m(0.40, 0.40), TFIDF: _m(0.45, 0.48)}, TFIDF),              # better on both: certainly
    ({MODEL: _m(0.30, 0.00), "global-median": _m(0.30, 0.00), TFIDF: _m(0.30, 0.0)}, "global-median"),  # cheapest first
    ({MODEL: _m(0.40, 0.40), TFIDF: _m(0.45, float("nan"))}, MODEL),      # a NaN never qualifies
    # the best of each metric is any predictor's, servable or not
    ({MODEL: _m(0.40, 0.40), TFIDF: _m(0.40, 0.40), "prompt-length-bin": _m(0.45, 0.40)}, MODEL),
    ({}, MODEL),
])
def test_fastest_within_ships_the_cheapest_inside_the_agreed_loss(block, want):
    assert fastest_within(block, 0.01, 0.02) == want


def test_route_slices_fastest_ships_tfidf_where_it_is_within_the_loss(shipped, tmp_path):
    """On the fixture's report TF-IDF outranks the untrained model on first turns, so ``fastest`` ships it there, and
    later turns, where it was not fitted, stay the model's; with no allowed loss and a model made best it ships none."""
    from training.cli import build_parser, config_from_args

    pkg = shutil.copytree(shipped["plain"], tmp_path / "fastest")
    routes = ship_routes(pkg, shipped["report"], {TFIDF: shipped["fitted"]}, mode="fastest")
    assert {k: r["predictor"] for k, r in routes.items()} == ROUTED
    meta = json.loads((pkg / "meta.json").read_text())
    assert meta["routes_by"].startswith("fastest within top-1 -0.01 and tau -0.02")
    assert OnnxLengthPredictor(pkg).route([[("user", "hi")]]) == [TFIDF]
    report = json.loads(json.dumps(shipped["report"]))
    report["slices"]["first_turn"][MODEL] = _m(1.0, 1.0)
    strict = shutil.copytree(shipped["plain"], tmp_path / "strict")
    routes = ship_routes(strict, report, {TFIDF: shipped["fitted"]}, mode="fastest", max_top1_drop=0, max_tau_drop=0)
    assert {k: r["predictor"] for k, r in routes.items()} == {"first_turn": MODEL, "later_turns": MODEL}
    assert OnnxLengthPredictor(strict).routes == {}
    cfg = config_from_args(build_parser().parse_args(["--data", "x", "--route-slices", "fastest", "--route-max-top1-drop",
                                                      "0.02", "--route-max-tau-drop", "0.05"]))
    assert (cfg.route_slices, cfg.route_max_top1_drop, cfg.route_max_tau_drop) == ("fastest", 0.02, 0.05)


def test_a_package_without_routes_predicts_as_before(shipped, splits):
    plain = OnnxLengthPredictor(shipped["plain"])
    convs = [_turns(e) for e in splits.test[:64]]
    assert plain.routes == {} and plain.meta.routes is None
    out = plain.predict(convs, quantile=0.7)
    before = plain.predict_encoded(plain.encode(convs), quantile=0.7)  # the path predict() took before routing
    for got, want in zip(out, before):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out.truncated, before.truncated)
    assert set(out.predictor) == {MODEL}


class Untrusted:
    """A type no slice file may hold."""


@pytest.mark.parametrize("damage, message", [
    ("garbage", "first_turn.skops cannot be read"),
    ("missing", "first_turn.skops is missing"),
    ("untrusted", "does not trust: tests.test_slice_routing.Untrusted"),
    ("other buckets", "predicts 9 buckets, the package's scheme has 3"),
    ("unservable route", "routes first_turn to 'prompt-length-bin' without a servable file"),
    ("unknown slice", "routes slice 'system_prompts'"),
])
def test_a_broken_slice_file_or_table_is_a_clear_error(shipped, tmp_path, damage, message):
    import skops.io as sio

    pkg = shutil.copytree(shipped["routed"], tmp_path / "broken")
    skops_file, meta_file = pkg / "slices/first_turn.skops", pkg / "meta.json"
    meta = json.loads(meta_file.read_text())
    if damage == "garbage":
        skops_file.write_bytes(b"not a zip file at all")
    elif damage == "missing":
        skops_file.unlink()
    elif damage == "untrusted":
        sio.dump({"format": 1, "predictor": TFIDF, "vectorizer": Untrusted()}, skops_file)
    elif damage == "other buckets":
        sio.dump({"format": 1, "predictor": "global-median", "dist": np.ones(9), "n_buckets": 9}, skops_file)
        meta["routes"]["first_turn"]["predictor"] = "global-median"
    elif damage == "unservable route":
        meta["routes"]["first_turn"] = {"predictor": "prompt-length-bin"}
    else:
        meta["routes"]["system_prompts"] = {"predictor": TFIDF, "file": "slices/first_turn.skops"}
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(SliceModelError, match=message.replace("(", r"\(").replace(")", r"\)")):
        OnnxLengthPredictor(pkg)


def _sidecar(pkg: Path, tmp: Path):
    """The real sidecar app over ``pkg``, in-process; entered, it has tried to load the package once."""
    from fastapi.testclient import TestClient

    from predictor.sidecar.app import create_app
    from predictor.sidecar.cache import ResolvedModel, parse_uri
    from predictor.sidecar.settings import SidecarSettings

    s = SidecarSettings(model=str(pkg), feedback_db=str(tmp / "fb.db"), reload_interval=0)
    return TestClient(create_app(s, parse_uri(str(pkg)), ResolvedModel(pkg, "routing-test", "1", str(pkg))))


def _wait_loaded(client) -> None:
    deadline = time.monotonic() + 120
    while client.get("/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)


def test_the_sidecar_says_which_predictor_made_each_prediction(shipped, tmp_path):
    pkg = shipped["routed"]
    local = OnnxLengthPredictor(pkg)
    convo = [{"role": "user", "content": "Tell me about Rome."}, {"role": "assistant", "content": "word " * 300},
             {"role": "user", "content": "And Carthage?"}]
    with _sidecar(pkg, tmp_path) as client:
        _wait_loaded(client)
        first = client.post("/v1/predict", json={"prompts": ["Write a haiku.", "Explain TCP in detail."]}).json()
        later = client.post("/v1/predict", json={"messages": convo}).json()
    assert [p["predictor"] for p in first["predictions"]] == [TFIDF, TFIDF]
    assert [p["prompt_tokens"] for p in first["predictions"]] == [0, 0]
    want = local.predict(["Write a haiku.", "Explain TCP in detail."])
    np.testing.assert_allclose([p["probs"] for p in first["predictions"]], want.probs, atol=1e-12)
    assert later["predictions"][0]["predictor"] == MODEL and later["predictions"][0]["prompt_tokens"] > 0
    want = local.predict([[(m["role"], m["content"]) for m in convo]])
    np.testing.assert_allclose(later["predictions"][0]["probs"], want.probs[0], atol=1e-5)


def test_a_sidecar_given_a_corrupt_slice_file_says_so(shipped, tmp_path):
    pkg = shutil.copytree(shipped["routed"], tmp_path / "corrupt")
    (pkg / "slices/first_turn.skops").write_bytes(b"PK not really")
    with _sidecar(pkg, tmp_path) as client:
        deadline = time.monotonic() + 120
        while "last load failed" not in client.post("/v1/predict", json={"prompt": "hi"}).text:
            assert time.monotonic() < deadline, "the load never failed"
            time.sleep(0.2)
        r = client.post("/v1/predict", json={"prompt": "hi"})
    assert r.status_code == 503 and "SliceModelError" in r.json()["detail"] and "first_turn.skops" in r.json()["detail"]


def _train(data: Path, work: Path, *flags: str) -> dict:
    from tests.tiny_package import tiny_base
    from training.cli import main

    base = work.parent / "tiny-base"
    if not base.exists():
        tiny_base(base, need_data("tokenizers/gpt2/tokenizer.json"))
    out = work / "metrics.json"
    rc = main(["--data", str(need_data(SHAREGPT)), "--format", "sharegpt",
               "--tokenizer", str(need_data("tokenizers/gpt2/tokenizer.json")), "--base-model", str(base),
               "--max-samples", "1200", "--epochs", "1", "--max-prompt-tokens", "32",
               "--edges", "64,256", "--max-tokens", "1024", "--experiment", "tests-routing", "--register", "routing-train",
               "--alias", "", "--work-dir", str(work), "--output-json", str(out), *flags])
    assert rc == 0
    return json.loads(out.read_text())


def test_train_predictor_ships_what_the_report_recommends(data, home, tmp_path_factory):
    """Two short real runs (a one-layer backbone, 1,200 examples): the default ships each slice's recommended servable
    predictor, and its registry version says so; --route-slices off ships the model alone and records no routes (that
    run skips the baselines to stay short: with auto, even then every slice's route would be recorded, as the model's)."""
    from mlflow import MlflowClient

    from registry import store

    root = tmp_path_factory.mktemp("train-routing")
    report = _train(data, root / "auto")
    meta = json.loads((root / "auto/package/meta.json").read_text())
    assert set(report["recommended"]) >= {"first_turn", "later_turns"}
    for part in ("first_turn", "later_turns"):
        best = report["recommended"][part]
        want = best if best in ("tfidf-logreg", "global-median") else MODEL
        assert meta["routes"][part]["predictor"] == want == report["routes"][part]["predictor"]
        assert meta["routes"][part]["test_metrics"] == pytest.approx(report["slices"][part][want], nan_ok=True)
        assert (root / "auto/package" / f"slices/{part}.skops").is_file() == (want != MODEL)
    # a one-layer model after one epoch does not outrank TF-IDF on ShareGPT (here on both slices): the baseline ships
    assert TFIDF in {r["predictor"] for r in meta["routes"].values()}
    tags = MlflowClient().get_model_version("routing-train", report["registered_version"]).tags
    assert tags[store.TAG_ROUTES] == routes_tag(meta["routes"])
    for part in ("first_turn", "later_turns"):  # the slice's offline figure is the served predictor's
        want = meta["routes"][part]["test_metrics"]["accuracy"]
        assert float(tags[f"{part}.accuracy"]) == pytest.approx(want, abs=1e-6)
    served = OnnxLengthPredictor(root / "auto/package")
    assert set(served.routes) == {p for p, r in meta["routes"].items() if r["predictor"] != MODEL}
    # every slice's TF-IDF model ships as the fast tier too, with its test figures, whatever the routes say
    assert meta["fast_tier"]["files"] == {p: f"fast/{p}.skops" for p in ("first_turn", "later_turns")}
    assert report["fast_tier"] == meta["fast_tier"]
    for part in ("first_turn", "later_turns"):
        assert meta["fast_tier"]["test_metrics"][part] == pytest.approx(report["slices"][part][TFIDF], nan_ok=True)
    assert set(served.fast_tier) == {"first_turn", "later_turns"}
    assert tags[store.TAG_FAST_TIER] == "tfidf-logreg:first_turn,later_turns"

    off = _train(data, root / "off", "--route-slices", "off", "--no-baselines")
    assert off["routes"] is None
    assert "routes" not in json.loads((root / "off/package/meta.json").read_text())
    assert not (root / "off/package/slices").exists()
    assert off["fast_tier"] is None and not (root / "off/package/fast").exists()  # no baselines, no fast tier
    assert store.TAG_FAST_TIER not in MlflowClient().get_model_version("routing-train", off["registered_version"]).tags
    assert store.TAG_ROUTES not in MlflowClient().get_model_version("routing-train", off["registered_version"]).tags


def test_cpu_per_first_turn_prediction_baseline_vs_onnx(shipped, splits, capsys):
    """Measured, printed: CPU time per first-turn prediction by the shipped baseline and by an ONNX model, one prompt at
    a time and in batches of 32. The ONNX model is the repository's MiniLM demo package when present (what serves by
    default), else the tiny test package (far cheaper than any real backbone)."""
    demo = Path(__file__).parents[1] / "demo-results/predictor/package"
    onnx_pkg = demo if (demo / "model.onnx").is_file() else shipped["plain"]  # fp32 reads the package, writes nothing
    onnx = OnnxLengthPredictor(onnx_pkg, threads=1)
    baseline = OnnxLengthPredictor(shipped["routed"], threads=1)
    prompts = [_turns(e) for e in splits.test if e.first_turn][:96]

    def cpu_ms(pred: OnnxLengthPredictor, batch: int) -> float:
        pred.predict(prompts[:batch])  # warm-up
        t = time.process_time()
        for i in range(0, len(prompts), batch):
            pred.predict(prompts[i:i + batch])
        return (time.process_time() - t) * 1000.0 / len(prompts)

    rows = {b: (cpu_ms(baseline, b), cpu_ms(onnx, b)) for b in (1, 32)}
    with capsys.disabled():
        print(f"\nCPU ms per first-turn prediction ({len(prompts)} ShareGPT first turns, 1 thread; ONNX: {onnx_pkg.name}, "
              f"{onnx.meta.backbone or '?'}, {onnx.input_format.max_tokens} input tokens)")
        for b, (tf, ox) in rows.items():
            print(f"  batch {b:>2}: tfidf-logreg {tf:.2f} ms   onnx {ox:.2f} ms   ({ox / tf:.1f}x)")
    assert set(baseline.predict(prompts[:4]).predictor) == {TFIDF}
    assert all(tf > 0 and ox > 0 for tf, ox in rows.values())


@pytest.fixture(scope="module")
def with_fast_tier(shipped, tmp_path_factory) -> Path:
    """The plain package plus the first-turn TF-IDF model as its fast tier (routes untouched)."""
    from training.routing import ship_fast_tier

    pkg = shutil.copytree(shipped["plain"], tmp_path_factory.mktemp("fast") / "pkg")
    tier = ship_fast_tier(pkg, shipped["report"], {TFIDF: shipped["fitted"]})
    assert tier["files"] == {"first_turn": "fast/first_turn.skops"} and "first_turn" in tier["test_metrics"]
    return pkg


def test_the_fast_tier_answers_as_the_fitted_baseline_and_leaves_routing_alone(with_fast_tier, shipped, splits):
    from predictor.slices import FAST_TIER_KEY

    pkg = OnnxLengthPredictor(with_fast_tier)
    first = [_turns(e) for e in splits.test if e.first_turn][:50]
    later = [_turns(e) for e in splits.test if not e.first_turn][:5]
    assert pkg.routes == {} and set(pkg.fast_tier) == {"first_turn"}
    assert pkg.has_fast_tier(first) and not pkg.has_fast_tier(first + later)
    fast = pkg.probs_fast(first)
    np.testing.assert_allclose(fast.probs, shipped["fitted"]["first_turn"].servable().probs(first))
    assert set(fast.predictor) == {TFIDF}
    # predict() still runs the encoder: the fast tier serves only a saturated sidecar
    np.testing.assert_array_equal(pkg.predict(first).probs, OnnxLengthPredictor(shipped["plain"]).predict(first).probs)
    assert OnnxLengthPredictor(shipped["plain"]).fast_tier == {}
    meta = json.loads((with_fast_tier / "meta.json").read_text())
    assert ship_routes is not None and meta[FAST_TIER_KEY]["predictor"] == TFIDF


@pytest.mark.alone  # a 200 ms deadline in wall time: beside the other lane's engines it ran 222 ms once
def test_a_saturated_sidecar_answers_late_callers_from_the_fast_tier_in_time(with_fast_tier, splits, tmp_path):
    """A real sidecar, one worker, its queue filled with four thousand prompts: a caller with a 200 ms timeout gets a
    fast-tier answer inside it (overflow true, predictor tfidf-logreg), the queue's own callers still get the encoder's,
    the metric counts the spill; with --no-fast-tier the same caller gets 504, counted as expired and never run."""
    import asyncio

    import httpx

    from serving.bench.predictor.sidecar import free_port, start_sidecar, wait_ready

    texts = [e.turns[-1].text[:2000] for e in splits.test if e.first_turn][:64]
    first = {"prompts": texts}

    async def saturate(url: str):
        async with httpx.AsyncClient(timeout=120) as c:
            backlog = [asyncio.create_task(c.post(f"{url}/v1/predict", json=first)) for _ in range(64)]
            await asyncio.sleep(0.1)  # the backlog is queued behind the first batches (about a second of work)
            t = time.perf_counter()
            late = await c.post(f"{url}/v1/predict", json={"prompt": texts[0]}, headers={"x-lengthwise-timeout-ms": "200"})
            took = time.perf_counter() - t
            queued = await asyncio.gather(*backlog)
            metrics = (await c.get(f"{url}/metrics")).text
        return late, took, queued, metrics

    for fast in (True, False):
        port = free_port()
        proc = start_sidecar(str(with_fast_tier), port, tmp_path / f"sidecar-{fast}.log",
                             ["--workers", "1", "--threads", "1"] + ([] if fast else ["--no-fast-tier"]))
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, proc, tmp_path / f"sidecar-{fast}.log")
            late, took, queued, metrics = asyncio.run(saturate(url))
        finally:
            proc.terminate()
            proc.wait(20)
        assert all(r.status_code == 200 for r in queued)
        assert all(not p["overflow"] and p["predictor"] == MODEL for r in queued for p in r.json()["predictions"])
        if fast:
            assert late.status_code == 200, late.text
            (p,) = late.json()["predictions"]
            assert p["overflow"] is True and p["predictor"] == TFIDF, p
            print(f"fast-tier answer: {p['latency_ms']:.0f} ms in the sidecar, {took * 1e3:.0f} ms at the client")
            assert p["latency_ms"] < 200 and took < 0.4
            assert "lengthwise_sidecar_fast_tier_prompts_total 1.0" in metrics
        else:
            assert late.status_code == 504 and "expired" in late.json()["detail"]
            # counted, and dropped unrun: the encoder's batches hold the backlog's prompts and nothing more
            assert "lengthwise_sidecar_expired_prompts_total 1.0" in metrics
            assert f"lengthwise_sidecar_batch_size_sum {64.0 * len(texts)}" in metrics


@pytest.mark.unit
def test_a_saved_tfidf_model_is_a_handful_of_files_whatever_its_vocabulary(tmp_path):
    """skops writes every numpy scalar as an array file of its own (and checks each new name against all the others),
    so a fitted vocabulary of numpy ints made a 50,000-term model a 50,000-file archive: minutes to save, seconds to
    load. Saved as Python ints the vocabulary is one JSON object, and the model predicts the same."""
    import zipfile

    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    from predictor.features import tfidf_matrix
    from predictor.slices import TfidfBuckets, load_model, save_model

    texts = [f"word{i} word{i + 1} common term{i % 7}" for i in range(2000)]
    hints = np.zeros((len(texts), 2))
    vec = TfidfVectorizer(max_features=3000).fit(texts)  # as training fits it: the cut leaves numpy ints
    y = np.arange(len(texts)) % 3
    clf = LogisticRegression(max_iter=50).fit(tfidf_matrix(vec, texts, hints), y)
    model = TfidfBuckets(vec, clf, np.unique(y), 3)
    assert len(vec.vocabulary_) > 2000 and isinstance(next(iter(vec.vocabulary_.values())), np.integer)
    path = tmp_path / "m.skops"
    save_model(model, path)
    with zipfile.ZipFile(path) as z:
        assert len(z.namelist()) < 50, len(z.namelist())
    back = load_model(path, 3)
    assert back.vectorizer.vocabulary_ == vec.vocabulary_
    conv = [[("user", "word5 word6 common")], [("user", "term3 nothing else")]]
    assert np.array_equal(back.probs(conv), model.probs(conv))
    assert isinstance(next(iter(vec.vocabulary_.values())), np.integer)  # saving left the fitted model as it was
