"""Spans of the gateway (a suite call, an activation) in the host's trace, exported over OTLP
to a local receiver, with `[suites.<name>] redact` keys masked in spans and logs while the
child gets the arguments unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.fakes.otlp import OtlpReceiver
from tests.test_gateway import mcp_json, stdio_host, text_of

TRACE_ID = "ab" * 16
PARENT_ID = "cd" * 8
SECRET = "s3cret-value-123"
NESTED = "tok-999-nested"


async def test_suite_calls_and_activations_are_spans_with_arguments_redacted(
    tmp_path: Path, otlp: OtlpReceiver
) -> None:
    mcp_json(tmp_path, "plain")
    (tmp_path / "gateway.toml").write_text('[suites.plain]\nredact = ["message", "token"]\n')
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url("http"),
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "BUTLERS_LOG_LEVEL": "debug",
    }
    async with stdio_host(tmp_path, env=env) as host:
        arguments = {"message": SECRET, "auth": {"token": NESTED, "user": "ann"}}
        call = {"action": "call", "subtool": "echo", "args": arguments}
        meta: Any = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}  # beside progressToken
        result = await host.client.call_tool("plain_suite", call, meta=meta)
        assert text_of(result) == SECRET  # the child got it unchanged
        await host.call("gateway_activate", name="plain")
    spans = await otlp.wait_for(
        lambda spans: {"gateway.suite_call", "gateway.activate"} <= {s.name for s in spans}
    )
    [suite_call] = [s for s in spans if s.name == "gateway.suite_call"]
    assert (suite_call.trace_id, suite_call.parent_span_id) == (TRACE_ID, PARENT_ID)
    assert suite_call.service == "butler-gateway"
    assert suite_call.attributes["child"] == "plain"
    assert suite_call.attributes["subtool"] == "echo"
    recorded = json.loads(suite_call.attributes["arguments"])
    assert recorded["args"] == {
        "message": "[redacted]",
        "auth": {"token": "[redacted]", "user": "ann"},
    }
    [activate] = [s for s in spans if s.name == "gateway.activate"]
    assert activate.attributes["child"] == "plain"
    everything = json.dumps([s.attributes for s in spans])
    assert SECRET not in everything and NESTED not in everything
    log = (tmp_path / "gateway.stderr").read_text()
    assert "Handler called: call_tool plain_suite" in log  # the debug log has the call
    assert SECRET not in log and NESTED not in log
