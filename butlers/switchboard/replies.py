"""reply: what the person reads, built from the butlers' answers.

People get the butlers' own answers, and for anything that went wrong one fixed, friendly
sentence per kind of failure. Error texts (endpoint URLs, a target's exceptions, driver
messages) never reach a chat or a mailbox: they go to the inbox row, routing_log and the log.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# One sentence per kind of failure (RouteError.kind, and the worker's own cases).
SORRY = {
    "unreachable": "Sorry, the {butler} butler is not reachable right now. Please try again later.",
    "timeout": (
        "Sorry, the {butler} butler took too long to answer. Part of it may be done already: "
        "ask it what it did before you try again."
    ),
    "failed": "Sorry, the {butler} butler could not finish that. Please try again later.",
    "out_of_turns": (
        "Sorry, the {butler} butler ran out of steps before it finished that. Part of it may "
        "be done already: ask it what it did, or ask for one thing at a time."
    ),
    "busy": (
        "Sorry, the {butler} butler could not get to that: the AI service it uses is "
        "overloaded or limiting requests (or this machine is short of room). Please try again "
        "later."
    ),
    "refused": "Sorry, I could not pass your message on to the right butler.",
    "internal": "Sorry, something went wrong on my side and your message was not handled.",
    "gave_up": "Sorry, I could not handle your message.",
}
RATE_LIMITED = (
    "You are sending messages faster than I can handle, so I will skip new ones for a while. "
    "Please try again in an hour."
)


def sorry(kind: str, butler: str | None = None) -> str:
    template = SORRY.get(kind, SORRY["internal"])
    return template.format(butler=butler or "right")


def _butlers(names: Sequence[str]) -> str:
    if len(names) == 1:
        return f"the {names[0]} butler"
    return f"the {', '.join(names[:-1])} and {names[-1]} butlers"


def answer_lost(butlers: Sequence[str], missed: Sequence[str] = ()) -> str:
    """The reply to a message its butlers took and answered before this process was
    interrupted, their answer not yet written: they are not asked again (it would be done
    twice: a reminder set twice, a mail sent twice). `missed`: those of it that had not
    answered then, named so that the sender asks them again."""
    said = (
        f"Sorry, {_butlers(butlers)} took your message and answered, but the answer was lost "
        "when I was interrupted. Ask again what was done if you need to know."
    )
    if missed:
        said += f" {_butlers(missed).capitalize()} had not answered: ask again for that part."
    return said


def reply_text(result: Any) -> str:
    """What the person reads of one answer: a butler's `trigger` result, or the result as
    text."""
    if isinstance(result, dict) and isinstance(result.get("result"), str):
        return result["result"]
    if isinstance(result, str):
        return result
    return json.dumps(result, ensure_ascii=False, default=str)


@dataclass(frozen=True)
class Answer:
    """One routed butler's part of a reply: its answer, or the kind of failure it met."""

    butler: str
    text: str | None = None
    failure: str | None = None  # a RouteError.kind when the route did not answer
    error: str | None = None  # the detail, for the inbox row and the log only

    @property
    def ok(self) -> bool:
        return self.failure is None


def combine(answers: Sequence[Answer]) -> str:
    """One reply for a message routed once or several times. A single answer is passed on as
    it is; several are each labelled with their butler, failures by their friendly sentence."""
    if len(answers) == 1:
        only = answers[0]
        return only.text or "" if only.ok else sorry(only.failure or "internal", only.butler)
    parts = []
    for answer in answers:
        body = answer.text if answer.ok else sorry(answer.failure or "internal", answer.butler)
        parts.append(f"{answer.butler}: {body}")
    return "\n\n".join(parts)
