"""Client side of the data plane: how block bytes move between the caller and the host tier.

``make_transport(name)`` picks an implementation by name and imports it lazily.
"""

from __future__ import annotations

from kvtier.transports.base import DataTransport


def make_transport(name: str) -> DataTransport:
    if name == "shm":
        from kvtier.transports.shm import ShmTransport

        return ShmTransport()
    if name == "cuda_ipc":
        from kvtier.transports.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport()
    if name == "tcp":
        from kvtier.transports.tcp import TcpTransport

        return TcpTransport()
    from kvtier_contract.errors import InvalidArgument

    raise InvalidArgument(
        f"unknown transport {name!r} (expected 'shm', 'tcp' or 'cuda_ipc')", field="transport"
    )


__all__ = ["DataTransport", "make_transport"]
