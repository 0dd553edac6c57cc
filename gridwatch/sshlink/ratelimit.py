"""Token buckets: how the agent keeps one caller (or one noisy log line) from taking all of it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second of ``clock``; :meth:`take` spends one."""

    rate: float
    burst: float
    clock: Callable[[], float] = time.monotonic
    tokens: float = field(init=False)
    _at: float = field(init=False)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1:
            raise ValueError(f"a token bucket needs a positive rate and a burst of at least 1, got {self.rate}, {self.burst}")
        self.tokens = float(self.burst)
        self._at = self.clock()

    def _refill(self) -> None:
        now = self.clock()
        # A clock that steps back (a test, NTP) must not drain the bucket.
        self.tokens = min(self.burst, self.tokens + max(now - self._at, 0.0) * self.rate)
        self._at = now

    def take(self) -> bool:
        """Spend a token if one is left; False when the caller is over its budget."""
        self._refill()
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def retry_after(self) -> float:
        """Seconds until the next token."""
        self._refill()
        return max(1.0 - self.tokens, 0.0) / self.rate


MAX_KEYS = 4096  # budgets kept at once (each console key, and each console behind a relay)


class KeyedBuckets:
    """One bucket per key (a client key's fingerprint), made on first use."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._buckets: dict[str, TokenBucket] = {}

    def bucket(self, key: str) -> TokenBucket:
        found = self._buckets.get(key)
        if found is None:
            if len(self._buckets) >= MAX_KEYS:
                # Keys behind relays come and go: the oldest budget is forgotten, memory stays bounded.
                del self._buckets[next(iter(self._buckets))]
            found = self._buckets[key] = TokenBucket(self.rate, self.burst, self.clock)
        return found

    def take(self, key: str) -> bool:
        return self.bucket(key).take()


class LogLimiter:
    """Lets a kind of log line through while its bucket has tokens; counts the ones it held back."""

    def __init__(self, rate: float = 0.2, burst: float = 10, clock: Callable[[], float] = time.monotonic) -> None:
        self._bucket = TokenBucket(rate, burst, clock)
        self.suppressed = 0

    def allow(self) -> int | None:
        """None: stay quiet; otherwise log now, saying how many lines were held back before this one."""
        if not self._bucket.take():
            self.suppressed += 1
            return None
        held, self.suppressed = self.suppressed, 0
        return held
