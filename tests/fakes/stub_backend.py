"""A serve backend with no model: it answers the routes that need none."""

from __future__ import annotations


class StubBackend:
    """``healthy`` can be flipped to play an engine that died."""

    model_id = "stub"

    def __init__(self) -> None:
        self.healthy = True

    def model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "owned_by": "butter"}

    def model_cards(self) -> list[dict]:
        return [self.model_card()]

    def metrics_text(self) -> str:
        return ""

    async def aclose(self) -> None:
        pass

    async def generate(self, request):
        raise AssertionError("no generation here")

    async def count_tokens(self, request) -> int:
        return 0
