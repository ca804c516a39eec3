"""The cache's one state: the index and what places its blocks, shared by its parts.

:class:`CacheState` is what :class:`~kvtierd.cache.TieredCache` hands its
:class:`~kvtierd.cache.reads.Reads` and :class:`~kvtierd.cache.stores.Stores` (and its own
namespace and session lifecycle): each part reads and writes it, none keeps a copy.
"""

from __future__ import annotations

from kvtierd.cache.admission import Admission
from kvtierd.cache.chain import TierLink
from kvtierd.cache.fleet import SharedLink
from kvtierd.cache.jobs import JobTable
from kvtierd.cache.residency import HostResidency
from kvtierd.index import Entry, NamespaceState
from kvtierd.policies import EvictionPolicy
from kvtierd.tiers import HostTier


class CacheState:
    """Owns the index (``namespaces``: their entries), the jobs, the chain of storage links
    below the host tier and the shared tier's link, and the cache's gauges; holds the host
    tier, its eviction policy and residency, and the admission (built by the cache).

    Concurrency: event-loop thread only, no locks; the cache's parts are its only writers.
    """

    def __init__(
        self,
        host: HostTier,
        policy: EvictionPolicy[Entry],
        residency: HostResidency,
        namespaces: dict[int, NamespaceState],
        jobs: JobTable,
        admission: Admission,
    ) -> None:
        self.host = host
        self.policy = policy
        self.residency = residency
        self.namespaces = namespaces
        self.jobs = jobs
        self.admission = admission
        self.chain: list[TierLink] = []
        self.fleet: SharedLink | None = None  # the shared tier, outside the index
        self.pinned_blocks = 0
        self.writing_blocks = 0
        self.verify_bytes = True
        """Give every committed block a digest (config ``verify_bytes``; set by the daemon)."""
