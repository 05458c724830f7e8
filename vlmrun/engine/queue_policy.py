"""The order the scheduler serves requests in: first come first served, or by priority (vLLM's policies).

`EngineConfig.scheduling_policy` names one; the scheduler asks it where a new or preempted request goes
in the waiting queue, how to order the running requests (the last is the one preempted when a running
request needs a page), and, when a waiting request finds no pages, which running request to preempt for it.

- "fcfs": arrival order. A new request joins the back of the waiting queue, a preempted one its front;
  the running requests keep their admission order (the newest is preempted first); a waiting request
  never preempts anyone. A non-zero `priority` is refused (vLLM answers so).
- "priority": by `(priority, arrival_time)`, lower first (vLLM's rule: a lower value is served sooner, ties
  by arrival). Both queues are kept in that order, so the preempted running request is the one with the
  highest value (the latest arrival among equals), and a waiting request that finds no pages preempts
  running requests ranked after it, lowest first, until it fits.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import deque
from typing import Optional, Protocol

from vlmrun.sampling_params import SamplingParamError

SCHEDULING_POLICIES = ("fcfs", "priority")


class Queued(Protocol):
    """What a policy reads of a request."""

    priority: int
    arrival_time: float


def rank(req: Queued) -> tuple[int, float]:
    """A request's place under the priority policy: lower first."""
    return req.priority, req.arrival_time


class QueuePolicy(ABC):
    """Where requests go in the scheduler's queues, and whom a waiting request may preempt."""

    name: str

    def check(self, priority: int) -> None:
        """A SamplingParamError (field "priority") for a priority this policy cannot honour."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise SamplingParamError("priority", f"priority must be an integer, got {priority!r}")

    @abstractmethod
    def enqueue(self, waiting: deque, req: Queued) -> None:
        """Put a new request into the waiting queue."""

    @abstractmethod
    def requeue(self, waiting: deque, req: Queued) -> None:
        """Put a preempted request back into the waiting queue."""

    def order_running(self, running: list) -> None:
        """Order the running requests in place before a step: the last is preempted first."""

    def admission_victim(self, running: list, req: Queued) -> Optional[Queued]:
        """The running request to preempt so that waiting `req` gets pages; None: `req` waits."""
        return None


class FCFSPolicy(QueuePolicy):
    name = "fcfs"

    def check(self, priority: int) -> None:
        super().check(priority)
        if priority != 0:
            raise SamplingParamError("priority", f"priority {priority} given but priority scheduling is not "
                                                 f"enabled (start the engine with scheduling_policy='priority')")

    def enqueue(self, waiting: deque, req: Queued) -> None:
        waiting.append(req)

    def requeue(self, waiting: deque, req: Queued) -> None:
        waiting.appendleft(req)


class PriorityPolicy(QueuePolicy):
    name = "priority"

    def enqueue(self, waiting: deque, req: Queued) -> None:
        waiting.insert(bisect.bisect_right(waiting, rank(req), key=rank), req)  # after its equals

    def requeue(self, waiting: deque, req: Queued) -> None:
        self.enqueue(waiting, req)  # its arrival time puts it before later arrivals of its priority

    def order_running(self, running: list) -> None:
        running.sort(key=rank)  # stable: equal ranks keep their order

    def admission_victim(self, running: list, req: Queued) -> Optional[Queued]:
        if not running:
            return None
        victim = max(running, key=rank)
        return victim if rank(victim) > rank(req) else None


def make_queue_policy(name: str) -> QueuePolicy:
    """The policy `name` ("fcfs" or "priority"); a ValueError naming the choices otherwise."""
    policies = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}
    if name not in policies:
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {name!r}")
    return policies[name]()
