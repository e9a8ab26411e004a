"""Placement: which engine instance gets a request (Aladdin §3–§4).

Pure Python over plain data, no HTTP and no vLLM, so the simulator and the gateway drive the same
objects.

``state.py``       a request as placement sees it (:class:`Job`) and an instance's view (:class:`Instance`)
``limits.py``      an instance's capacity: projected KV at every future step, the ATGT and TTFT limits
``history.py``     observed output lengths, for Aladdin's re-prediction E[L | L > predicted]
``policies.py``    round-robin, JSQ, power-of-two (TetriInfer), Aladdin best-fit, and ours; by name
``rebalance.py``   Aladdin Alg. 2: move not-yet-started requests to balance prediction error
``scaling.py``     Aladdin Eq. 7: instances = ceil(k5 · rate + c5), fitted from history
"""

from serving.placement.history import LengthHistory
from serving.placement.limits import Limits
from serving.placement.policies import PLACEMENTS, Placement, PlacementError, make_placement, placement_names
from serving.placement.rebalance import Move, rebalance
from serving.placement.state import Instance, Job

__all__ = ["PLACEMENTS", "Instance", "Job", "LengthHistory", "Limits", "Move", "Placement", "PlacementError", "make_placement",
           "placement_names", "rebalance"]
