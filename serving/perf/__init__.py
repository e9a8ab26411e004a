"""Performance models shared by every layer above: step latency (analytic, published, fitted), hardware and
model specs, and the SLOs requests are judged by. Imports nothing of the simulator, the gateway or the plug-in."""
