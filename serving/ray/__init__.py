"""``lengthwise serve --backend ray``: the serving stack as one Ray Serve application, for more than one machine.

========================= ===========================================================================
``routing.py``            replicas' routing stats as placement views; the placement core decides (no Ray here)
``router.py``             ``LengthwiseRequestRouter``: Ray Serve's request router over ``routing.py``, power-of-two
                          choice when the stats are missing or stale; Ray's default router, timed (the bench's baseline)
``timing.py``             the routers' time in ``choose_replicas``, shared with the ingress's ``/health``
``engine.py``             an engine replica: vLLM ``AsyncLLM`` with the scheduler plug-in, per-request routing stats
``ingress.py``            the OpenAI ingress: the gateway's request steps, forwarding through the engine handle; a
                          replica that dies costs a retry, or ends a stream that began with an error event
``sidecar.py``            the length predictor's sidecar app as a deployment
``app.py``                the application: engines behind the router, the ingress, the sidecar
``deploy.py``             the application builders a Serve config file names (``serve run``, KubeRay's ``RayService``)
``cli.py``                ``lengthwise serve --backend ray``: deploy on a local or existing cluster and serve
========================= ===========================================================================
"""
