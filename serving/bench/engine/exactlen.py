"""The benchmark's length control: each request ends at exactly its trace length, where no scheduler can see it.

Every request of ``bench engine`` carries the same ``max_tokens`` (the bench's cap), for stock vLLM and for the plug-in
alike, so that the scheduler learns nothing from it. Its true length travels in ``SamplingParams.extra_args`` under
:data:`TRUE_LEN_KEY`, a key of the benchmark's own: the plug-in reads only the keys of
:class:`serving.policy.hints.SchedulingHints`, which ignores every other key. The key is read by
:class:`ExactLengthLogitsProcessor`, a vLLM V1 logits processor (``LLM(logits_processors=[...])``) that runs in the
sampler, after the scheduler has decided the step: until a request has its length minus one tokens it masks
:data:`STOP_TOKEN_ID`; at that point it leaves that token the only one possible. The token is the request's
``stop_token_ids``, so vLLM's own stop check (``check_stop``) finishes the request with that token as its last output
token: ``len(token_ids)`` is exactly the trace length. The engine runs without a tokenizer (``skip_tokenizer_init``),
so the stop rests on ``stop_token_ids``, never on a tokenizer's EOS; ``ignore_eos`` keeps the dummy model's own EOS
from ending a request early.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

if TYPE_CHECKING:
    from vllm.config import VllmConfig

TRUE_LEN_KEY = "bench_true_output_len"
"""``extra_args`` key: the request's trace length, read by the logits processor only (never by the plug-in)."""
STOP_TOKEN_ID = 4095
"""The token that ends every bench request: the last id of the tokenizer-free dummy vocabulary (4,096 ids), inside the
GPT-2-sized one too; bench prompts use ids 3 to 4,002 and the dummy models' EOS is 2 (or GPT-2's 50,256)."""


def exact_length_params(true_len: int, max_tokens: int, extra_args: dict[str, Any] | None = None) -> SamplingParams:
    """Greedy sampling params of one bench request: ``max_tokens`` the bench's cap, ``true_len`` enforced out of sight."""
    if not 1 <= true_len <= max_tokens:
        raise ValueError(f"a trace length of {true_len} tokens does not fit max_tokens={max_tokens}")
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, stop_token_ids=[STOP_TOKEN_ID],
                          extra_args={**(extra_args or {}), TRUE_LEN_KEY: int(true_len)})


def _target(params: SamplingParams) -> int | None:
    return (params.extra_args or {}).get(TRUE_LEN_KEY)


class ExactLengthLogitsProcessor(LogitsProcessor):
    """Ends each request that carries :data:`TRUE_LEN_KEY` at exactly that many output tokens; leaves others alone.

    State per row of vLLM's persistent batch: the target length and a reference to the row's output token list (vLLM
    keeps that list current, with a placeholder per token still in flight under async scheduling, so its length is
    the count of tokens sampled before this step). Both masks are applied with one indexed write each per step.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[int, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        n = _target(sampling_params)
        if n is None:
            return
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{TRUE_LEN_KEY} must be a positive integer, got {n!r}")
        if sampling_params.max_tokens is not None and n > sampling_params.max_tokens:
            raise ValueError(f"{TRUE_LEN_KEY}={n} exceeds max_tokens={sampling_params.max_tokens}")
        if STOP_TOKEN_ID not in (sampling_params.stop_token_ids or ()):
            raise ValueError(f"{TRUE_LEN_KEY} needs stop_token_ids to hold {STOP_TOKEN_ID}")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: greedy sampling must see it

    @staticmethod
    def _new_row(params: SamplingParams, _prompt_ids: list[int] | None, output_ids: list[int]) -> tuple[int, list[int]] | None:
        n = _target(params)
        return None if n is None else (int(n), output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        hold, stop = [], []
        for row, (n, out) in self.rows.items():
            (stop if len(out) + 1 >= n else hold).append(row)
        if hold:
            logits[hold, STOP_TOKEN_ID] = float("-inf")
        if stop:
            logits[stop] = float("-inf")
            logits[stop, STOP_TOKEN_ID] = 0.0
        return logits
