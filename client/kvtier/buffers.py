"""Turn caller blocks (bytes-like, numpy arrays, torch CPU tensors) into flat byte views.

No numpy or torch import here: objects are recognised by what they offer, so ``import kvtier``
stays cheap. A view shares memory with the caller's object; nothing is copied.
"""

from __future__ import annotations

from typing import Any

from kvtier_contract.errors import InvalidArgument


def byte_view(obj: Any, *, writable: bool = False, field: str = "blocks") -> memoryview:
    """A 1-D unsigned-byte memoryview over ``obj``'s memory (C-contiguous required)."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_cuda"):  # torch.Tensor, duck-typed
        if obj.is_cuda:
            raise InvalidArgument("CUDA tensors are not accepted by put/get: copy to CPU first", field=field)
        if not obj.is_contiguous():
            raise InvalidArgument("tensor must be contiguous", field=field)
        import torch  # already imported by whoever made the tensor

        obj = obj.detach().reshape(-1).view(torch.uint8).numpy()
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgument(
            f"expected a bytes-like object, numpy array or CPU tensor, got {type(obj).__name__}", field=field
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument("buffer must be C-contiguous", field=field)
    if writable and view.readonly:
        raise InvalidArgument("buffer is read-only", field=field)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
