"""butter on Ray Serve: N replicas of one model behind one address, routed by prefix.

Needs ``pip install 'butter-core[ray]'``; nothing else in butter imports this package.

- ``butter serve --model M --replicas N`` starts a local Ray (or joins ``--ray-address``).
- ``serve run butter.ray:app model=M replicas=N`` deploys on a running Ray: :func:`app`.
"""

from __future__ import annotations

from typing import Any


def app(args: dict[str, Any]) -> Any:
    """Serve's application builder: ``butter serve``'s flags as ``key=value`` arguments."""
    from butter.ray.launch import app_from_options

    return app_from_options(args)


__all__ = ["app"]
