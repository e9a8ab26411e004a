"""The serving endpoint (``lengthwise serve``): an OpenAI-compatible gateway in front of vLLM engines.

One request's path (docs/architecture.md), one module per step:

========================= ===========================================================================
``gateway.py``            the path itself: one :class:`~serving.gateway.gateway.Gateway` method per step below,
                          testable without HTTP (``app.py`` is its FastAPI adapter)
``auth.py``               API keys: who may call (bearer keys as ``vllm serve --api-key``, 401 in OpenAI's shape)
``admission.py``          how much work is accepted: requests in flight, 429 with ``Retry-After`` past the bound
``concurrency.py``        each engine's bound learnt from the SLO its answers meet (``--engine-bound slo``)
``requests.py``           validate the OpenAI body (4xx with an OpenAI-style error, never a traceback)
``schema.py``             every field's type against vLLM's own request schema (``vllm_requests.json``)
``prediction.py``         ask the sidecar ``/v1/predict`` (short timeout) or fall back to a fixed length
``target.py``             is the sidecar's predictor made for the served model? (checked at start and while serving)
``slo.py``                the deadline: ``x-slo-ttft-ms``/``x-slo-tpot-ms`` or EcoServe's JCT SLO
``hints.py``              put the prediction and the deadline into ``vllm_xargs`` for the plug-in
``tokens.py``             count the prompt's tokens (the local model's tokenizer, else characters / 4)
``placement.py``          choose an engine: the placement core (``serving.placement``: round-robin, jsq, p2c,
                          aladdin, lengthwise) over one view per engine, JSQ when the engines' reports are stale
``forward.py``            send it, retry on another engine while nothing reached the client, stream SSE
``feedback.py``           post the actual output length to the sidecar ``/v1/feedback`` in the background
``shaping.py``            withhold it when the client, not the model, decided the length (stop strings, sampling, ...)
``pool.py``               the engines: health checks, each engine's view, models they serve
``engine_load.py``        read an engine's vLLM ``/metrics``: running, waiting, KV use and KV capacity
``metrics.py``            Prometheus metrics; ``app.py`` the FastAPI app; ``cli.py`` the command line (engines it starts:
                          :mod:`serving.launch.engines`)
========================= ===========================================================================

Nothing here imports vLLM or torch: the gateway is a small process beside the engines (transformers' fast
tokenizer is loaded when ``--model`` is a local directory, for exact prompt lengths).
"""
