"""What placement knows about requests and instances: the host (simulator or gateway) keeps it current.

A :class:`Job` is Aladdin's per-request row (Table 1): prompt length l_in, predicted output l_pred,
tokens generated so far l_out, and whether it has started (only not-started jobs may move). An
:class:`Instance` is one engine as a placement sees it: its jobs and its health. Hosts update these
incrementally (a job is added when placed, ``generated`` grows as tokens come back, the job is removed
when it finishes), so a placement decision never walks an engine's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class Job:
    rid: int
    prompt_len: int
    pred_len: float                  # predicted output tokens (total)
    arrival: float = 0.0
    generated: int = 0               # output tokens produced so far (l_out)
    started: bool = False            # the engine began its prefill: it can no longer be moved
    first_token_at: float | None = None
    repredicted: float | None = None  # total output to plan for after an overrun (set by the host's LengthHistory)

    @property
    def planned_len(self) -> float:
        """The total output this job is planned to reach: the prediction, or the re-prediction after an overrun."""
        if self.generated >= self.pred_len:
            return max(self.repredicted or 0.0, self.generated + 1.0)
        return self.pred_len

    @property
    def remaining(self) -> float:
        """Predicted output tokens still to come (at least one)."""
        return max(1.0, self.planned_len - self.generated)

    @property
    def context(self) -> int:
        """Tokens with KV once started: prompt plus generated."""
        return self.prompt_len + self.generated


@dataclass(eq=False)
class Instance:
    """One engine instance as a placement sees it."""

    name: str
    healthy: bool = True
    jobs: dict[int, Job] = field(default_factory=dict)
    # Aladdin Alg. 2's error accumulators for requests that finished before their prediction since the last
    # re-balancing (finished jobs leave ``jobs``, so their error is kept here until it is used)
    early_tokens: float = 0.0
    early_count: int = 0
    overruns_seen: set[int] = field(default_factory=set)  # jobs whose overrun Alg. 2 already used
    kv_tokens: int | None = None  # this instance's KV capacity when it differs from the fleet's (mixed hardware)

    @property
    def outstanding(self) -> int:
        return len(self.jobs)

    @property
    def outstanding_tokens(self) -> float:
        return sum(j.remaining for j in self.jobs.values())

    def add(self, job: Job) -> None:
        if job.rid in self.jobs:
            raise ValueError(f"request {job.rid} is already placed on {self.name}")
        self.jobs[job.rid] = job

    def finish(self, rid: int) -> Job | None:
        """Remove a finished job; one that beat its prediction feeds Alg. 2's overestimate error."""
        job = self.jobs.pop(rid, None)
        self.overruns_seen.discard(rid)
        if job is not None and job.generated < job.pred_len:
            self.early_tokens += job.generated - job.pred_len
            self.early_count += 1
        return job

    def remove(self, rid: int) -> Job | None:
        """Take a job off without feedback (moved elsewhere, aborted)."""
        self.overruns_seen.discard(rid)
        return self.jobs.pop(rid, None)
