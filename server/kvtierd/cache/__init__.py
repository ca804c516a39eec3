"""The cache: the index's only writer, the jobs, host residency and the chain of tiers below.

See :mod:`kvtierd.cache.cache` for the primitives and :mod:`kvtierd.cache.admission` for what a
tenant may hold (the completions that hash around them, digests: kvtierd.service.transfers).
"""

from kvtierd.cache.cache import TieredCache
from kvtierd.cache.chain import TierLink
from kvtierd.cache.jobs import Job, JobTable, LoadJob, StoreJob

__all__ = ["Job", "JobTable", "LoadJob", "StoreJob", "TierLink", "TieredCache"]
