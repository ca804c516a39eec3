"""kvtier_contract: the one contract that the SDK (``kvtier``) and the daemon (``kvtierd``) share.

What both halves must agree on, each defined once: the error hierarchy and its gRPC status table
(:mod:`~kvtier_contract.errors`), identity and hashing (:mod:`~kvtier_contract.identity`), the
data-channel frames and the shm handshake (:mod:`~kvtier_contract.wire`), byte units
(:mod:`~kvtier_contract.units`), the CUDA driver-API calls both sides make
(:mod:`~kvtier_contract.cudadrv`), protobuf helpers and the generated protobuf modules
(:mod:`~kvtier_contract.v1`).

Import rule (checked by tests/unit/repository/test_import_rules.py): this package imports nothing of
``kvtier`` or ``kvtierd``; ``kvtierd`` imports only this package of the client side; ``kvtier``
never imports ``kvtierd``. Importing it is cheap (no torch, cupy or vLLM).
"""
