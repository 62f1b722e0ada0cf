"""The check of a call's arguments against its tool's schema before the owner is asked
(butlers.schema_check): what it refuses, and what a hostile schema cannot make it do."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path
from typing import Any

from butlers.schema_check import schema_problems


def test_schema_problems_names_each_argument_and_what_was_wrong() -> None:
    schema = {
        "type": "object",
        "properties": {
            "path": {"type": "string"},
            "limit": {"type": "integer", "minimum": 1},
            "edit": {
                "type": "object",
                "properties": {"old": {"type": "string"}},
                "required": ["old"],
            },
        },
        "required": ["path"],
    }
    assert schema_problems(schema, {"path": "a", "limit": 2, "edit": {"old": "x"}}) == ""
    assert schema_problems(schema, {"limit": "ten", "edit": {}}) == (
        "edit.old: required; limit: 'ten' is not of type 'integer'; path: required"
    )
    assert schema_problems({"type": "nonsense"}, {}) == ""  # unreadable: the tool judges


def test_a_servers_schema_fetches_nothing_and_runs_no_regular_expression(
    tmp_path: Path,
) -> None:
    """A tool server's schema is its author's (a red team): a `$ref` to a URL was fetched
    (with no timeout, on the event loop) and one to a file read, and its `pattern` run on
    what the model wrote (`^(a+)+$` held the loop for seconds). Neither is followed: the
    tool judges those itself."""
    fetched: list[str] = []

    class Server(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fetched.append(self.path)
            body = b'{"type": "object", "required": ["leak"]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = tmp_path / "probe.json"
    probe.write_text('{"type": "object", "required": ["leak"]}')
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metadata"
        for ref in (url, f"file://{probe}"):
            assert schema_problems({"type": "object", "$ref": ref}, {}) == ""
    finally:
        server.shutdown()
        server.server_close()
    assert fetched == []
    # A reference within the schema is still followed.
    within = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "required": ["q"]}}}
    assert schema_problems(within, {}) == "q: required"
    patterned = {
        "type": "object",
        "properties": {"q": {"type": "string", "pattern": "^(a+)+$"}},
        "patternProperties": {"^x_": {"type": "integer"}},
        "additionalProperties": False,
    }
    assert schema_problems(patterned, {"q": "a" * 28 + "!", "x_y": 1}) == ""
    assert schema_problems(patterned, {"q": 3}) == "q: 3 is not of type 'string'"


def test_a_property_named_pattern_is_an_argument_like_any_other() -> None:
    """The filesystem server's search_files takes `path` and `pattern`, and says no other
    (additionalProperties false): a guarded call of it was refused, "pattern: not an
    argument it takes", because the check dropped every key called pattern (a review)."""
    schema = {
        "type": "object",
        "properties": {"path": {"type": "string"}, "pattern": {"type": "string"}},
        "required": ["path", "pattern"],
        "additionalProperties": False,
    }
    assert schema_problems(schema, {"path": "/tmp", "pattern": "*.txt"}) == ""
    assert schema_problems(schema, {"path": "/tmp"}) == "pattern: required"
    data = {"type": "object", "properties": {"mode": {"enum": [{"pattern": "x"}]}}}
    assert schema_problems(data, {"mode": {"pattern": "x"}}) == ""  # data, not a schema
    assert schema_problems(data, {"mode": {"pattern": "y"}}) != ""


def test_a_schema_too_costly_to_follow_is_not_followed() -> None:
    """A chain of $defs, each anyOf two $refs to the next, is small and exponential to
    follow (16 links: 5 s on the event loop: a review); references that loop, and
    uniqueItems (quadratic), are not followed either: the tool judges."""
    links = 14
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(links)}
    defs[f"d{links}"] = {"type": "integer"}
    chain = {"type": "object", "properties": {"x": {"$ref": "#/$defs/d0"}}, "$defs": defs}
    assert schema_problems(chain, {"x": "a string"}) == ""
    short = {**chain, "$defs": {"d0": {"anyOf": [{"$ref": "#/$defs/d1"}] * 2}, "d1": defs["d14"]}}
    assert (
        schema_problems(short, {"x": "a string"})
        == "x: 'a string' is not valid under any of the given schemas"
    )
    looping = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    assert schema_problems(looping, {}) == ""
    unique = {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}
    assert schema_problems(unique, {"xs": [{"a": 1}, {"a": 1}]}) == ""
