"""The litestar edge: app factory, routes, SSE framing, the one error mapping."""
