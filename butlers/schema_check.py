"""Whether a call's arguments fit its tool's input schema, checked before the call is put to
the owner (butlers.approvals): the owner is never asked to approve a call its tool would
refuse. The butler's own tools validate with pydantic when they run, a tool server's in its
own process: this is the common measure, for a call that is recorded before it runs.

A tool server's schema is its author's, and the arguments are what a model wrote on a
stranger's words (red teams, then a review), so the check is lenient and bounded, never the
tool's last word:
- read on its own: no `$ref` outside the schema is resolved (jsonschema's default fetched any
  http: or file: URL, with no timeout, on the event loop);
- no regular expression runs (`pattern`, `patternProperties`: a server's `^(a+)+$` against 28
  characters the model wrote held the loop 6 s; Python's `re` cannot be cut short), and no
  `uniqueItems` (quadratic over a list of objects);
- not at all past CHECK_BUDGET: a chain of `$defs`, each `anyOf` two `$ref`s to the next, is
  small and exponential to follow (16 links: 5 s); nor a schema whose references loop.
What is not checked here, the tool judges itself.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# Schema nodes, counted with every internal `$ref` followed, times the argument values they
# are applied to (at least 1): ~20 us a node and value measured, so about 0.4 s at most.
CHECK_BUDGET = 20_000
_MAX_DEPTH = 64  # of a schema walked (a deeper one is not checked)
# Keywords whose values are data, not schemas (not walked).
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


class _TooCostly(Exception):
    """The schema is not checked: over CHECK_BUDGET, too deep, or its references loop."""


def schema_problems(schema: dict[str, Any], arguments: dict[str, Any]) -> str:
    """What `schema` refuses in `arguments`, one clause per problem ("text: required; limit:
    'x' is not of type 'integer'"); "" when nothing, or when it is not checked (above)."""
    from jsonschema.exceptions import SchemaError, UnknownType
    from referencing import Registry
    from referencing.exceptions import Unresolvable

    try:
        _check_cost(schema, arguments)
        validator_class = _lenient_validator()
        validator_class.check_schema(schema)
        validator = validator_class(schema, registry=Registry())
        # The first few: a list of 100,000 wrong items would format 100,000 messages.
        errors = list(itertools.islice(validator.iter_errors(arguments), 5))
    except (_TooCostly, SchemaError, UnknownType, Unresolvable, RecursionError):
        return ""
    said = []
    for error in errors:
        where = [str(part) for part in error.path]
        if error.validator == "required":
            missing = [name for name in error.validator_value if name not in error.instance]
            said += [".".join([*where, name]) + ": required" for name in missing]
        elif error.validator == "additionalProperties":
            extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
            said += [".".join([*where, name]) + ": not an argument it takes" for name in extra]
        else:
            said.append(f"{'.'.join(where) or 'arguments'}: {error.message}")
    return "; ".join(sorted(said))


@functools.cache
def _lenient_validator() -> Any:
    """Draft 2020-12 without the keywords that run a server's regular expressions or are
    quadratic; `additionalProperties` beside `patternProperties` is not checked either (which
    names it allows only those expressions say)."""
    from jsonschema import Draft202012Validator, validators

    def unchecked(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[Any]:
        return iter(())

    additional = Draft202012Validator.VALIDATORS["additionalProperties"]

    def additional_properties(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        if "patternProperties" in schema:
            return iter(())
        return additional(validator, value, instance, schema)

    return validators.extend(
        Draft202012Validator,
        {
            "pattern": unchecked,
            "patternProperties": unchecked,
            "uniqueItems": unchecked,
            "additionalProperties": additional_properties,
        },
    )


def _check_cost(schema: Any, arguments: Any) -> None:
    """_TooCostly when following `schema` over `arguments` could take more than CHECK_BUDGET
    steps."""
    budget = CHECK_BUDGET // max(1, _values(arguments, CHECK_BUDGET))
    sizes: dict[str, int] = {}  # an internal `$ref` -> the size of what it names, followed
    following: set[str] = set()

    def size(node: Any, depth: int) -> int:
        if depth > _MAX_DEPTH:
            raise _TooCostly
        total = 1
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                    total += referenced(value, depth)
                elif key not in _DATA_KEYWORDS:
                    total += size(value, depth + 1)
                if total > budget:
                    raise _TooCostly
        elif isinstance(node, list):
            for item in node:
                total += size(item, depth + 1)
                if total > budget:
                    raise _TooCostly
        return total

    def referenced(ref: str, depth: int) -> int:
        if ref in sizes:
            return sizes[ref]
        if ref in following:  # a loop: how far it goes depends on the arguments
            raise _TooCostly
        following.add(ref)
        sizes[ref] = size(_pointed(schema, ref), depth + 1)
        following.discard(ref)
        return sizes[ref]

    size(schema, 0)


def _pointed(root: Any, ref: str) -> Any:
    """What the JSON pointer of `ref` ("#/$defs/a") names in `root`; None where nothing."""
    node = root
    for part in ref[1:].split("/")[1:]:
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(key)
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _values(value: Any, most: int) -> int:
    """How many values `value` holds (itself included), counted up to `most`."""
    count, stack = 0, [value]
    while stack and count < most:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count
