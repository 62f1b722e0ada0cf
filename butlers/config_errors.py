"""pydantic's ValidationError as a message a person can act on: `file: key: problem, expected ...`.

The config models (butler.toml, gateway.toml, switchboard.config.json, .mcp.json) validate
with pydantic; its own messages ("Input should be a valid integer") name neither the file nor
the key in the file's spelling, and say nothing about unknown keys beyond "not permitted".
This module walks the failing location through the model to say which key it is (as the file
spells it), what was expected (from the field's type and constraints, or an `Expect` given
with the field), and, for an unknown key, which known key was probably meant.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from butlers.errors import ConfigError, KeyProblem

MORE_ERRORS_SHOWN = 3  # besides the first; the rest are counted


@dataclasses.dataclass(frozen=True)
class Expect:
    """Field metadata: what to say a key expects, when its type alone says it badly
    (`Annotated[int, Expect("a port number between 1 and 65535")]`)."""

    text: str


def config_error(
    path: Path, error: ValidationError, model: type, *, by_alias: bool = False
) -> ConfigError:
    """The ConfigError for `error`, raised validating `path` as `model` (`by_alias`: the file
    spells its keys as the fields' aliases): its first problem, then a few more (a file with
    three typos shows all three). A .json file's tables are called objects."""
    style = _Style(by_alias, "an object" if path.suffix == ".json" else "a table")
    problems = [_describe(detail, model, style) for detail in error.errors(include_url=False)]
    key, problem = problems[0]
    more = [f"{k}: {p}" if k else p for k, p in problems[1 : 1 + MORE_ERRORS_SHOWN]]
    if len(problems) > 1 + MORE_ERRORS_SHOWN:
        more.append(f"{len(problems) - 1 - MORE_ERRORS_SHOWN} more")
    if more:
        problem += "; also " + "; ".join(more)
    return ConfigError(path, key or None, problem)


def expectation(field: FieldInfo, *, json: bool = False) -> str:
    """What a key expects, in the words its errors use ("a positive integer"): for the docs."""
    place = _Place(key="", field=field, annotation=field.annotation, parent=None, item=None)
    return _expected(place, _Style(by_alias=json, table="an object" if json else "a table"))


@dataclasses.dataclass(frozen=True)
class _Style:
    """How the file spells things: keys by alias or by name; a table, or a JSON object."""

    by_alias: bool
    table: str


@dataclasses.dataclass
class _Place:
    """Where a location in the data ends up in the model."""

    key: str  # the file's spelling: "switchboard.triage[0].pattern"
    field: FieldInfo | None  # the field the location ends in, if it ends in one
    annotation: Any  # the type expected there
    parent: Any  # the model the last key belongs to (for unknown keys)
    item: int | None  # set when the location ends inside a list of scalars


def _describe(detail: ErrorDetails, model: type, style: _Style) -> tuple[str, str]:
    place = _place(model, detail["loc"], style.by_alias)
    kind, given, ctx = detail["type"], detail.get("input"), detail.get("ctx") or {}
    error = ctx.get("error")
    if isinstance(error, KeyProblem):
        return _join(place.key, error.key), error.problem
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return place.key, _unknown_key(place, style.by_alias)
    expected = _expected(place, style)
    if kind == "missing":
        return place.key, f"is required, expected {expected}"
    if isinstance(error, ValueError) and kind in ("value_error", "assertion_error"):
        return place.key, str(error)
    got = f"got {_shown(given)}"
    if place.item is not None:
        got = f"item {place.item} is {_shown(given)}"
    if _quoted_scalar(kind, given):
        got += ", a string: write it without the quotes"
    return place.key, f"expected {expected}, {got}"


def _quoted_scalar(kind: str, given: Any) -> bool:
    """A number or a boolean written in quotes (`port = "8101"`): TOML makes it a string, and
    "expected a port number between 1 and 65535, got '8101'" reads as a contradiction."""
    if not isinstance(given, str) or kind not in ("int_type", "float_type", "bool_type"):
        return False
    text = given.strip()
    if kind == "bool_type":
        return text in ("true", "false")
    try:
        (int if kind == "int_type" else float)(text)
    except ValueError:
        return False
    return True


def _place(model: type, loc: Sequence[int | str], by_alias: bool) -> _Place:
    key, annotation, parent, field, item = "", model, model, None, None
    for part in loc:
        annotation = _unoptional(annotation)
        fields = _fields(annotation)
        if fields is not None and isinstance(part, str):
            parent = annotation
            name = _field_name(fields, part, by_alias)
            field = fields.get(name) if name else None
            annotation = _annotated(field) if field is not None else Any
            key = _join(key, part)
            continue
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if isinstance(part, int) and origin in (tuple, list):
            element = args[0] if args else Any
            if _fields(_unoptional(element)) is None:
                item = part  # a scalar of a list: the key stays the list's
            else:
                key += f"[{part}]"
            annotation = element
        elif origin is dict and isinstance(part, str):
            key = _join(key, part)
            annotation = args[1] if len(args) == 2 else Any
            field = None
    return _Place(key, field, annotation, parent, item)


def _unknown_key(place: _Place, by_alias: bool) -> str:
    fields = _fields(place.parent) or {}
    known = [_spelling(name, info, by_alias) for name, info in fields.items()]
    noun = getattr(place.parent, "UNKNOWN_KEY_NOUN", "key")
    given = place.key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(given, known, n=1)
    if close:
        return f"unknown {noun}, did you mean {close[0]!r}?"
    return f"unknown {noun}, expected one of: {', '.join(known)}"


def _expected(place: _Place, style: _Style) -> str:
    """What the key expects, from its `Expect` if it has one, else its type and bounds."""
    annotation = place.annotation
    if place.item is not None and place.field is not None:
        annotation = _annotated(place.field)
    for item in _metadata(place.field, annotation):
        if isinstance(item, Expect):
            return item.text
    return _phrase(annotation, style, place.field)


def _phrase(annotation: Any, style: _Style, field: FieldInfo | None = None) -> str:
    base = _unoptional(annotation)
    origin, args = typing.get_origin(base), typing.get_args(base)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (tuple, list):
        return "a list of " + _plural(_phrase(args[0], style)) if args else "a list"
    if origin is dict or _fields(base) is not None:
        return style.table
    if base is re.Pattern or origin is re.Pattern:
        return "a regular expression"
    noun = {str: "a string", bool: "true or false", int: "an integer", float: "a number"}.get(
        base, "a value"
    )
    metadata = _metadata(field, annotation)
    longest = [item.max_length for item in metadata if isinstance(item, annotated_types.MaxLen)]
    if base is str and longest:
        return f"a string of at most {longest[0]} characters"
    low, high = _limits(metadata)
    if low == (">", 0) and high is None:
        return f"a positive {'integer' if base is int else 'number'}"
    if low and high and low[0] == ">=" and high[0] == "<=":
        return f"{noun} between {low[1]} and {high[1]}"
    return noun + "".join(f" {bound[0]} {bound[1]}" for bound in (low, high) if bound)


def _limits(metadata: list[Any]) -> tuple[tuple[str, Any] | None, tuple[str, Any] | None]:
    """The lower and upper bound a field's constraints set, as (operator, value)."""
    low: tuple[str, Any] | None = None
    high: tuple[str, Any] | None = None
    for item in metadata:
        if isinstance(item, annotated_types.Gt):
            low = (">", item.gt)
        elif isinstance(item, annotated_types.Ge):
            low = (">=", item.ge)
        elif isinstance(item, annotated_types.Lt):
            high = ("<", item.lt)
        elif isinstance(item, annotated_types.Le):
            high = ("<=", item.le)
    return low, high


def _plural(phrase: str) -> str:
    for article in ("a ", "an "):
        if phrase.startswith(article):
            noun, _, rest = phrase[len(article) :].partition(" ")
            return f"{noun}s {rest}".rstrip()
    return phrase


def _fields(annotation: Any) -> dict[str, FieldInfo] | None:
    """The fields of a pydantic model or pydantic dataclass; None for anything else."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.model_fields
    return getattr(annotation, "__pydantic_fields__", None)


def _field_name(fields: dict[str, FieldInfo], spelled: str, by_alias: bool) -> str | None:
    for name, info in fields.items():
        if _spelling(name, info, by_alias) == spelled:
            return name
    return None


def _spelling(name: str, info: FieldInfo, by_alias: bool) -> str:
    return (info.alias or name) if by_alias else name


def _annotated(field: FieldInfo) -> Any:
    return field.annotation


def _metadata(field: FieldInfo | None, annotation: Any) -> list[Any]:
    found = list(field.metadata) if field is not None else []
    found += list(_annotated_metadata(annotation))
    return found


def _annotated_metadata(annotation: Any) -> Iterator[Any]:
    if typing.get_origin(annotation) is typing.Annotated:
        for item in annotation.__metadata__:
            # Field(gt=0) inside Annotated[...] stays a FieldInfo holding the constraints.
            yield from item.metadata if isinstance(item, FieldInfo) else [item]
        yield from _annotated_metadata(typing.get_args(annotation)[0])
    elif _is_union(annotation):
        for arg in typing.get_args(annotation):
            if arg is not type(None):
                yield from _annotated_metadata(arg)


def _strip(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _unoptional(annotation: Any) -> Any:
    annotation = _strip(annotation)
    if _is_union(annotation):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return _strip(rest[0])
    return annotation


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
