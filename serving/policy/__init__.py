"""The scheduling-policy core: engine-agnostic, deterministic, pure Python (no vLLM, no torch).

One module per job: ``request`` (a request and its prediction; the vocabulary PT, GT, RL, TFS, KVC is explained
there), ``kv`` (the block ledger), ``ordering``, ``deadline``, ``pipelining``, one module per policy family
(``baselines``, ``ecoserve``, ``lengthwise``), ``base`` (the interface), ``registry`` (every policy by name),
``config`` (the knobs) and ``hints`` (what a request carries from the gateway). The vLLM plug-in
(``serving/engine``) and the simulator (``serving/sim``) drive the same objects.
"""
