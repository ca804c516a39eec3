"""PublishPrefix and ListPrefixes: a group's published prefixes (docs/security.md § Groups).

Sessionless, like Stats: the caller is the credential's tenant (``Scope.caller``; None on a
single-tenant daemon). The rules (who publishes, the bounds, what a caller is told) are the
registry's, :class:`kvtierd.tenancy.prefixes.PublishedPrefixes`; this family translates the
proto messages. gRPC only (not on the control channel). Event-loop thread only.
"""

from __future__ import annotations

from typing import Any

from kvtier_contract.v1 import kvtier_pb2 as pb
from kvtierd.service.scope import Scope, ServiceSettings
from kvtierd.tenancy.prefixes import PublishedPrefixes


class PrefixHandlers:
    """PublishPrefix and ListPrefixes (see the module docstring). Owns nothing: the registry is
    the daemon's."""

    def __init__(self, scope: Scope, settings: ServiceSettings, prefixes: PublishedPrefixes) -> None:
        self.scope = scope
        self.settings = settings
        self.prefixes = prefixes

    async def PublishPrefix(self, request: pb.PublishPrefixRequest, context: Any) -> Any:
        caller, r = self.scope.caller(), request
        if r.withdraw:
            existed = await self.prefixes.withdraw(caller, r.group, r.name)
        else:
            existed = await self.prefixes.publish(caller, r.group, r.name, r.tokens, bytes(r.digest))
        return pb.PublishPrefixReply(boot_epoch=self.settings.boot_epoch, existed=existed)

    async def ListPrefixes(self, request: pb.ListPrefixesRequest, context: Any) -> Any:
        listed = self.prefixes.listed(self.scope.caller())
        return pb.ListPrefixesReply(
            boot_epoch=self.settings.boot_epoch,
            prefixes=[
                pb.PublishedPrefix(
                    group=p.group, name=p.name, tokens=p.tokens, digest=p.digest, publisher=p.publisher
                )
                for p in listed
            ],
        )
