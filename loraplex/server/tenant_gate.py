"""Each tenant's generation requests in flight, against its `max_concurrent_requests` quota.

Counted on the event loop (one thread: no lock) from the moment a request is let in until its
answer ends (the last streamed chunk, or the whole body), so a tenant at its limit gets a 429 with
Retry-After, the status the server's own pending-request limit answers with.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from loraplex.server.limits import TenantQuotas


class TenantGate:
    def __init__(self, quotas_of: Callable[[str], TenantQuotas]) -> None:
        self.quotas_of = quotas_of
        self.running: Counter[str] = Counter()

    def enter(self, tenant: str) -> Callable[[], None]:
        """Count one request of `tenant` (or raise its 429); returns the call that ends it, which
        ends it once however often it is called."""
        self.quotas_of(tenant).check_concurrency(tenant, self.running[tenant])
        self.running[tenant] += 1
        done = False

        def leave() -> None:
            nonlocal done
            if not done:
                done = True
                self.running[tenant] -= 1

        return leave
