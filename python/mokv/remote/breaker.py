"""CircuitBreaker: stop asking a server that keeps failing, and try again later.

    state      calls allowed                    leaves when
    closed     all                              `failure_threshold` failures in a row -> open
    open       none (each refusal is counted)   `cooldown_s` after it opened -> half-open
    half-open  one trial call at a time         the trial succeeds -> closed; fails -> open

Every opening (from closed or half-open) counts as a trip. A dead server thus costs
at most `failure_threshold` bounded timeouts, then one trial per `cooldown_s`, and
never more. Thread-safe: the store's callers and its writer thread share one breaker.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class CircuitBreaker:
    """Counts consecutive failures of a remote service and refuses calls while open."""

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold.__class__ is not int or failure_threshold < 1:
            raise ValueError(f"failure_threshold must be a positive int, got {failure_threshold!r}")
        if cooldown_s.__class__ not in (int, float) or not 0 < cooldown_s < math.inf:
            raise ValueError(
                f"cooldown_s must be a finite number of seconds > 0, got {cooldown_s!r}"
            )
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None  # None: closed
        self._trial_running = False
        self.trips = 0
        self.refused = 0

    @property
    def state(self) -> str:
        """ "closed", "open" or "half-open" (pure)."""
        with self._lock:
            if self._opened_at is None:
                return "closed"
            return "half-open" if self._clock() - self._opened_at >= self.cooldown_s else "open"

    def allow(self) -> bool:
        """Whether a call may go to the server now; a True in half-open state is the
        one trial, which the caller must end with `success` or `failure`."""
        with self._lock:
            if self._opened_at is None:
                return True
            if self._clock() - self._opened_at >= self.cooldown_s and not self._trial_running:
                self._trial_running = True
                return True
            self.refused += 1
            return False

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._trial_running = False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._trial_running or (
                self._opened_at is None and self._failures >= self.failure_threshold
            ):
                self._opened_at = self._clock()
                self._trial_running = False
                self.trips += 1
