"""Schema fuzz against a real `butter serve`: bodies drawn by hypothesis-jsonschema from
the request schemas the server publishes at /schema/openapi.json, a third sent as drawn
and the rest broken one way each (a key dropped, retyped or added, a leaf retyped, not
an object at all, a lone surrogate, invalid UTF-8, cut short).

Lengths are capped at 4 tokens. Hypothesis stops at MAX_EXAMPLES or after SECONDS,
whichever comes first, and never shrinks: every 5xx is collected with its body instead.
"""

from __future__ import annotations

import json

import httpx
import pytest
from support import hostile

FLAGS = ("--parallel", "4", "--threads", "1")  # see test_hostile.py
MAX_EXAMPLES = 400
SECONDS = 90.0


def test_the_published_schemas_are_the_fuzzed_ones(server):
    schemas = hostile.request_schemas(server.root)
    assert set(schemas) == set(hostile.POST_ROUTES)
    assert schemas[hostile.MESSAGES]["required"] == ["messages", "max_tokens"]


@pytest.mark.slow  # 90 seconds of fuzzing
def test_fuzzed_bodies_get_no_5xx(start_server):
    server = start_server(*FLAGS)
    report = hostile.fuzz(server.root, max_examples=MAX_EXAMPLES, seconds=SECONDS)
    print(f"\nfuzz: {report.tried} cases tried in {report.seconds:.0f} s (seed {report.seed}), "
          f"{dict(report.by_class)}, {dict(report.by_kind)}")
    assert report.tried >= 50, report.to_dict()
    assert report.by_class["2xx"] > 0 and report.by_class["4xx"] > 0, report.to_dict()
    assert report.five_xx == 0, json.dumps(report.server_errors[:10], indent=1)
    assert not report.server_errors, json.dumps(report.server_errors[:10], indent=1)
    metrics = server.wait_idle(timeout=60)
    assert all(metrics[name] == 0 for name in hostile.GAUGES), metrics
    assert httpx.get(f"{server.root}/health", timeout=10).text == "ok"
    assert "Traceback" not in server.log_text()
