"""``lengthwise serve --backend ray``: the serving stack as one Ray Serve application, for more than one machine.

========================= ===========================================================================
``routing.py``            replicas' routing stats as placement views; the placement core decides (no Ray here)
``router.py``             ``LengthwiseRequestRouter``: Ray Serve's request router over ``routing.py``, power-of-two
                          choice when the stats are missing or stale
========================= ===========================================================================
"""
