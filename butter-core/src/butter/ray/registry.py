"""The request routers living in this process, by deployment name.

Serve pickles a router's module by value, so a registry kept in that module would be a
copy per router: it lives here instead. The ingress asks its replicas' router which
replicas exist (for ``/metrics`` and ``/health``) and targets each by id.
"""

from __future__ import annotations

import weakref
from typing import Any

ROUTERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def router_for(deployment: str) -> Any:
    """The router of ``deployment``'s handle in this process, once it routed a call."""
    return ROUTERS.get(deployment)
