"""The block index: key -> entry, and the entry state machine. Never touches bytes."""

from kvtierd.index.entry import Entry, EntryState, NamespaceState

__all__ = ["Entry", "EntryState", "NamespaceState"]
