"""A request as the scheduling policies see it.

Vocabulary (EcoServe, used throughout ``serving.policy``):

* **PT** — prompt task: the prefill of a request's prompt (possibly in chunks).
* **GT** — generation task: the decode phase, one output token per step.
* **RL** — response length in tokens; **predicted RL** is what the length predictor said.
* **TFS** — target forward size: tokens per step that saturate the accelerator.
* **KVC** — the KV cache, managed in blocks of ``block_size`` tokens.

Token accounting follows vLLM V1: a request has ``prompt_len`` prompt tokens and ``generated``
output tokens; ``computed`` tokens already have KV. A step gives it ``n`` tokens with
``computed + n <= seq_len``; when the step reaches ``seq_len`` it emits one new output token. There is
no separate prefill phase in this state machine: after a recompute preemption ``computed`` drops to 0
and the request catches up through the same rule.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from enum import Enum


def capped_length(length: float, max_tokens: int | None) -> float:
    """A predicted length as a host hands it to the policy: at least one token, at most the request's ``max_tokens``
    (no cap when it is unset). The plug-in and the simulator both cap through here, so they agree."""
    return max(1.0, min(float(length), float(max_tokens) if max_tokens else math.inf))


@dataclass(frozen=True, slots=True)
class Prediction:
    """A response-length prediction.

    ``length`` is the point estimate the policies allocate and group by (already a quantile if the
    caller wants padding by quantile). ``edges``/``probs`` (optional) are the bucket distribution, used
    to re-predict the remaining length of a request that outlived its prediction.
    """

    length: float
    hi: float | None = None
    bucket: int | None = None
    edges: tuple[int, ...] | None = None
    probs: tuple[float, ...] | None = None

    def remaining_after(self, generated: int) -> float:
        """Expected further tokens given the response is already longer than ``generated``.

        With a bucket distribution this is the conditional mean of the buckets above ``generated``
        (each bucket taken at its centre, the part below ``generated`` cut off); without one, the
        request is assumed to need as much again as it was first predicted (doubling), never less
        than one block's worth of patience (16 tokens).
        """
        if self.edges and self.probs:
            lo_edges = (0, *self.edges)
            mass = 0.0
            acc = 0.0
            for i, p in enumerate(self.probs):
                lo = lo_edges[i]
                hi = self.edges[i] if i < len(self.edges) else max(self.edges[-1] * 2, generated + 1)
                if hi <= generated:
                    continue
                lo = max(lo, generated)
                mass += p
                acc += p * (lo + hi) / 2
            if mass > 1e-9:
                return max(16.0, acc / mass - generated)
        return max(16.0, self.length)


def after(generated: int, remaining: float, edges: tuple[int, ...] | None = None, probs: tuple[float, ...] | None = None,
          max_tokens: int | None = None) -> Prediction:
    """A prediction of the tokens still to come after ``generated`` (a refinement: the remaining-length predictor read
    the answer so far) as one of the whole length, which is what a policy holds: the point and every bucket edge
    shifted by ``generated``, the point capped to ``max_tokens`` as a host caps every prediction."""
    shifted = tuple(generated + e for e in edges) if edges else None
    return Prediction(length=capped_length(generated + max(1.0, remaining), max_tokens), edges=shifted,
                      probs=probs if shifted else None)


class Phase(str, Enum):
    WAITING = "waiting"      # queued, no KV computed (new or recompute-preempted)
    PREFILL = "prefill"      # PT in progress (chunked)
    GT_QUEUED = "gt_queued"  # decoupled policies: prompt KV held, waiting for a GT slot
    RUNNING = "running"      # decoding (or, for coupled policies, admitted)
    PAUSED = "paused"        # offload-free preemption: KV kept, out of the batch, waiting to regroup
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """One request; ``rid`` is unique per run. Policies never read the true RL."""

    rid: int
    arrival: float
    prompt_len: int
    pred: Prediction
    deadline: float = math.inf
    max_tokens: int | None = None
    generated: int = 0
    computed: int = 0
    phase: Phase = Phase.WAITING
    # RL the policy currently plans for (predicted RL, later re-predicted); set by the policy.
    planned_rl: int = 0
    preemptions: int = 0
    pauses: int = 0
    first_scheduled: float | None = None
    extra: dict = field(default_factory=dict)
    service: str = ""  # the model or LoRA adapter it is for (several services in one engine); "" for the one model
    priority: int = 0  # its priority class (a catalogue's priority): lower runs first in the vLLM-loop policies
    client: str = ""  # an opaque id of the client key that sent it ("" unknown): caps one key's share of a learnt prior
    # whether its length is the model's own: False when the client could shape it (max_tokens reached, stop sequences,
    # ignore_eos, min_tokens...), so no learner of lengths takes it as a sample
    learnable: bool = True

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.generated

    @property
    def uncomputed(self) -> int:
        return self.seq_len - self.computed

    def advance(self, n: int) -> bool:
        """Apply ``n`` scheduled tokens; return True if this step emits an output token."""
        if n <= 0 or self.computed + n > self.seq_len:
            raise ValueError(f"request {self.rid}: cannot schedule {n} tokens with {self.computed}/{self.seq_len} computed")
        self.computed += n
        if self.computed == self.seq_len:
            self.generated += 1
            return True
        return False

    def emits_token(self, n: int) -> bool:
        """Whether scheduling ``n`` tokens now would emit an output token (without applying it)."""
        return self.computed + n == self.seq_len


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` tokens of KV."""
    return -(-max(tokens, 0) // block_size)


class SortedQueue:
    """A queue kept sorted by a static key, with O(log n) binary search on the key.

    Entries are ``(key, seq, request)``; ``seq`` breaks ties in insertion order, so a key that is the
    same for everyone gives FCFS.
    """

    def __init__(self) -> None:
        self._items: list[tuple[tuple, int, Request]] = []
        self._pos: dict[int, tuple[tuple, int]] = {}
        self._seq = 0

    def push(self, key: tuple, req: Request, front: bool = False) -> None:
        self._seq += 1
        seq = -self._seq if front else self._seq
        bisect.insort(self._items, (key, seq, req), key=_entry_order)
        self._pos[req.rid] = (key, seq)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self):
        return (e[2] for e in self._items)

    def peek(self, i: int = 0) -> Request:
        return self._items[i][2]

    def key(self, i: int) -> tuple:
        return self._items[i][0]

    def pop(self, i: int = 0) -> Request:
        req = self._items.pop(i)[2]
        del self._pos[req.rid]
        return req

    def __contains__(self, req: Request) -> bool:
        return req.rid in self._pos

    def remove(self, req: Request) -> None:
        """Remove ``req`` in O(log n) search (plus the list shift)."""
        pos = self._pos.pop(req.rid)
        i = bisect.bisect_left(self._items, pos, key=_entry_order)
        if i >= len(self._items) or self._items[i][2] is not req:
            raise KeyError(req.rid)
        del self._items[i]

    def bisect_key(self, key: tuple, lo: int = 0, hi: int | None = None) -> int:
        """Index of the first entry whose key is >= ``key`` within ``[lo, hi)``."""
        return bisect.bisect_left(self._items, key, lo, len(self._items) if hi is None else hi, key=lambda e: e[0])


def _entry_order(e: tuple) -> tuple:
    return e[0], e[1]
