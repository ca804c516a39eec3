"""The cache: the index's only writer, the jobs, host residency and the chain of tiers below.

See :mod:`kvtierd.cache.cache` for the primitives, :mod:`kvtierd.cache.admission` for what a
tenant may hold, and :mod:`kvtierd.cache.flows` for the flows around them that hash (digests).
"""

from kvtierd.cache.cache import TieredCache
from kvtierd.cache.chain import TierLink
from kvtierd.cache.jobs import Job, JobTable, LoadJob, StoreJob

__all__ = ["Job", "JobTable", "LoadJob", "StoreJob", "TierLink", "TieredCache"]
