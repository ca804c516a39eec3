"""The cluster tier: blocks shared across nodes through a Redis/Valkey Cluster.

``settings`` (no dependencies) is what config and callers use; ``tier`` (``ClusterTier``),
``nodes`` and ``format`` need redis-py and xxhash and are imported only when a cluster is
configured.
"""
