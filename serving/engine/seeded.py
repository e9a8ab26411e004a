"""Per-request seeds on vLLM-CPU: undo the random draws of a discarded sample, as the CUDA build does.

vLLM samples a token for every scheduled row, also for a request whose prompt is only partly prefilled (a chunk);
that token is discarded, and the runner rewinds the request's own generator (``SamplingParams.seed``) by the Philox
offset the draw consumed (``gen.set_offset(gen.get_offset() - 4)`` in ``GPUModelRunner._bookkeeping_sync``). CPU
generators are Mersenne twisters without an offset, so vLLM-CPU 0.32 fails that step with ``RuntimeError: CPU Generator
does not use offset`` and the engine dies: any seeded request whose prompt is chunked (chunked prefill is the
default, and every length-aware policy chunks prompts to its forward size) kills a CPU engine.

:func:`install` makes those rewinds work on CPU (:func:`register`, a vLLM general plug-in, calls it in every process
vLLM starts; the benchmarks and ``lengthwise relabel`` also call it themselves, so their runs never depend on
``VLLM_PLUGINS``): each seeded request's generator becomes a
:class:`RewindableGenerator` whose state is saved before every draw, and the runner's rewind restores that state. A
request then consumes exactly one draw per kept token, whatever the chunking, so the same seed gives the same sample
path under any scheduler (up to the floating-point effects of batching on the logits), which is what makes a seeded
relabel of the served model reproduce the served lengths. CUDA generators are left alone.
"""

from __future__ import annotations

from typing import Any

import torch

_INSTALLED = False


class RewindableGenerator(torch.Generator):
    """A CPU generator that remembers its state before the last draw and can go back to it."""

    before: torch.Tensor | None = None  # (torch.Generator is built in __new__: no __init__ of its own to extend)

    def remember(self) -> None:
        self.before = self.get_state()

    def get_offset(self) -> int:  # the runner only ever asks in order to subtract the draw's offset and set it back
        return 0

    def set_offset(self, offset: int) -> RewindableGenerator:
        if self.before is not None:
            self.set_state(self.before)
        return self


def register() -> None:
    """vLLM's general plug-in hook (entry point ``vllm.general_plugins``), run in every process vLLM starts, workers
    included: ``vllm serve`` on a CPU samples in a worker process that the scheduler plug-in never runs in. Installs
    the fix on CPU builds only; set ``VLLM_PLUGINS`` to a list without ``lengthwise_seeded`` to leave vLLM alone."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install()


def install() -> bool:
    """Patch vLLM's input batch and sampler in this process (idempotent); returns whether the patch is active.

    The state is saved at the sampler's entry, once per step for every seeded row, whichever sampling path then
    runs (vLLM-CPU's Gumbel-max kernel draws one seed per row; the native path draws exponential noise), and
    also when that step draws nothing for the row: a rewind then restores the state the step began with.
    """
    global _INSTALLED
    if _INSTALLED:
        return True
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker import gpu_input_batch

    add_request = gpu_input_batch.InputBatch.add_request
    forward = Sampler.forward

    def add_request_rewindable(self, request, *args: Any, **kwargs: Any):
        gen = getattr(request, "generator", None)
        if gen is not None and gen.device.type == "cpu" and not isinstance(gen, RewindableGenerator):
            g = RewindableGenerator(device="cpu")
            g.set_state(gen.get_state())
            request.generator = g
        return add_request(self, request, *args, **kwargs)

    def forward_remembering(self, logits: torch.Tensor, sampling_metadata, *args: Any, **kwargs: Any):
        for g in sampling_metadata.generators.values():
            if isinstance(g, RewindableGenerator):
                g.remember()
        return forward(self, logits, sampling_metadata, *args, **kwargs)

    gpu_input_batch.InputBatch.add_request = add_request_rewindable
    Sampler.forward = forward_remembering
    _INSTALLED = True
    return True
