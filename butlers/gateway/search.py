"""`--mode search`: every child's exposed tools in one BM25 index, asked in plain words.

Each tool is a document of its name (split on `_`, `-` and camelCase, counted twice: a name
says most), its description and its parameters' names. BM25 is written out here (Lucene's
always-positive idf, k1 = 1.2, b = 0.75) rather than taken from `rank-bm25` or `bm25s`: both
need numpy, which the gateway does not otherwise load; measured here, `import rank_bm25` took
100-106 ms and numpy is 73 MB installed, for an index of a few hundred short documents that
this file scores in well under a millisecond. (`rank-bm25`'s last release is from 2022.)

The index is a snapshot of the children's tool lists, kept by identity: a child's list is
replaced, never changed in place, whenever the gateway reads it again (start, restart,
`notifications/tools/list_changed`), so a list that is not the one indexed means rebuild.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

K1 = 1.2
B = 0.75
NAME_WEIGHT = 2  # a name's words count this many times
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset(
    "a an the of to in on for and or is it its with by as at from this that be are can "
    "me my i you your please".split()
)


def stem(word: str) -> str:
    """Harman's S-stemmer, then a final "e" off and "-ed"/"-ing" off longer words: plurals
    to singular ("files" -> "fil", as "file"; "entries" -> "entry"), "-ches", "-shes",
    "-sses", "-xes" and "-zes" to their word ("compresses" -> "compress", "matches" and
    "match" alike; the S-stemmer alone made them "compresse", missing "Compresses a single
    file": a walkthrough), and "scheduled", "schedule" and "scheduling" alike; so a request's
    words meet a description's whatever their number or tense."""
    if len(word) > 3 and word.endswith("ies") and not word.endswith(("eies", "aies")):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("ches", "shes", "sses", "xes", "zes")):
        word = word[:-2]
    elif len(word) > 3 and word.endswith("es") and not word.endswith(("aes", "ees", "oes")):
        word = word[:-1]
    elif len(word) > 2 and word.endswith("s") and not word.endswith(("us", "ss", "is")):
        word = word[:-1]
    if len(word) > 4 and word.endswith("ed") and not word.endswith("eed"):
        word = word[:-2]
    if len(word) > 3 and word.endswith("e"):
        word = word[:-1]
    return word


def words(text: str) -> list[str]:
    """Lower-case stemmed words of `text`, camelCase and snake/kebab names split, stop words
    out."""
    split = _CAMEL.sub(" ", text).lower()
    return [stem(w) for w in _WORD.findall(split) if w not in _STOP]


@dataclass(frozen=True)
class Entry:
    """One exposed tool of one child, as the child lists it."""

    server: str
    tool: dict[str, Any]

    @property
    def name(self) -> str:
        return str(self.tool["name"])


def document(tool: dict[str, Any]) -> list[str]:
    """The words a tool is found by: its name (weighted), description and parameter names."""
    schema = tool.get("inputSchema") or {}
    properties = schema.get("properties") if isinstance(schema, dict) else None
    params = " ".join(properties) if isinstance(properties, dict) else ""
    return (
        words(str(tool["name"])) * NAME_WEIGHT
        + words(str(tool.get("description") or ""))
        + words(params)
    )


@dataclass
class SearchIndex:
    """BM25 over `entries`; `snapshot` is what it was built from (see the module's doc)."""

    entries: list[Entry]
    # The lists themselves, not their ids: a list freed by a restart could lend its id to
    # the next one.
    snapshot: tuple[tuple[str, list[dict[str, Any]]], ...] = ()
    _docs: list[Counter[str]] = field(default_factory=list)
    _lengths: list[int] = field(default_factory=list)
    _idf: dict[str, float] = field(default_factory=dict)
    _average: float = 0.0
    _held: list[list[dict[str, Any]]] = field(default_factory=list)  # their ids stay theirs

    @classmethod
    def build(
        cls, entries: list[Entry], sources: Sequence[tuple[str, list[dict[str, Any]]]]
    ) -> SearchIndex:
        index = cls(entries, snapshot=tuple((name, tools) for name, tools in sources))
        index._held = [tools for _, tools in sources]
        docs = [Counter(document(e.tool)) for e in entries]
        index._docs = docs
        index._lengths = [sum(d.values()) for d in docs]
        index._average = sum(index._lengths) / len(docs) if docs else 0.0
        frequency: Counter[str] = Counter(w for d in docs for w in d)
        n = len(docs)
        index._idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in frequency.items()}
        return index

    def fresh(self, sources: Sequence[tuple[str, list[dict[str, Any]]]]) -> bool:
        return len(self.snapshot) == len(sources) and all(
            name == was_name and tools is was
            for (name, tools), (was_name, was) in zip(sources, self.snapshot, strict=True)
        )

    def search(self, query: str, limit: int) -> list[Entry]:
        """The best `limit` entries for `query`, best first; none that share no word with it.
        Ties keep the children's and their tools' order."""
        asked = words(query)
        scored: list[tuple[float, int]] = []
        for i, doc in enumerate(self._docs):
            score = 0.0
            norm = K1 * (1 - B + B * self._lengths[i] / (self._average or 1))
            for word in asked:
                tf = doc.get(word, 0)
                if tf:
                    score += self._idf[word] * tf * (K1 + 1) / (tf + norm)
            if score > 0:
                scored.append((-score, i))
        scored.sort()
        return [self.entries[i] for _, i in scored[:limit]]

    def callable_name(self, entry: Entry) -> str:
        """What gateway_describe and gateway_call take for `entry`: the tool's own name, or
        `server/tool` where more than one server has a tool of that name."""
        if sum(1 for e in self.entries if e.name == entry.name) > 1:
            return f"{entry.server}/{entry.name}"
        return entry.name

    def resolve(self, name: str) -> list[Entry]:
        """The entries `name` may mean: one, several (a name more than one server has), or
        none."""
        plain = [e for e in self.entries if e.name == name]
        if plain:
            return plain
        return [e for e in self.entries if f"{e.server}/{e.name}" == name]
