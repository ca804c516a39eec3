"""Protobuf message -> plain dict with every field present and integers kept as ints."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def to_dict(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            if f.is_repeated:
                out[f.name] = [to_dict(v) for v in value]
            else:
                out[f.name] = to_dict(value)
        elif f.is_repeated:
            out[f.name] = list(value)
        else:
            out[f.name] = value
    return out
