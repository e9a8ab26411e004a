"""Which models share which GPUs: placement of a fleet's models onto GPU meshes (MuxServe §3.2, SeaLLM §4).

Pure Python over plain data and the step models of :mod:`serving.perf`, so the simulator's fleet bench and a
deployment's plan read the same objects.

``plan.py``       a plan: meshes (LLM units), the models each serves and their shares
``estimate.py``   what a mesh can serve: MuxServe's throughput estimator, and a load by predicted lengths
``muxserve.py``   MuxServe's greedy by computation onto the mesh of largest estimated throughput gain
``seallm.py``     SeaLLM's groups by parallelism and services by their unserved index, scored by a simulator
``lengthwise.py`` ours: packing by each model's predicted KV and decode demand
"""
