"""The scheduling-policy core: engine-agnostic, deterministic, pure Python (no vLLM, no torch).

One module per job: ``request`` (a request and its prediction; the vocabulary PT, GT, RL, TFS, KVC is explained
there), ``kv`` (the block ledger), ``ordering``, ``deadline``, ``pipelining``, one module per policy family
(``baselines``, ``ecoserve``, ``lengthwise``, ``seallm``, ``muxserve``, ``posterior``), ``belief`` (a request's length as
a distribution conditioned on what it has written), ``priors`` (what a service's finished requests teach), ``base``
(the interface), ``registry`` (every policy by name),
``config`` (the knobs), ``hints`` (what a request carries from the gateway) and ``learnable`` (which answers' lengths
any learner of lengths may take, and a window one client key holds at most a share of). The vLLM plug-in
(``serving/engine``) and the simulator (``serving/sim``) drive the same objects.
"""
