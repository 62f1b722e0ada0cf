"""How the owner's answer by mail is read (butlers.text.answer_line and the approval and
pairing patterns on it): the first line alone, bounded, so that a stranger's mail of spaces
costs nothing (it cost minutes to a pattern that read it whole: a review), and a first line
that says more is no answer. And how the call they answer is shown (escaped_disguises)."""

from __future__ import annotations

import pytest

from butlers.switchboard.approvals import _MAIL_ANSWER, _MAIL_ANSWER_ALONE, _MAIL_BARE_ANSWER
from butlers.switchboard.pairing import _MAIL_PAIRING_ANSWER
from butlers.text import ANSWER_LINE_CHARS, answer_line


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Yes, please.\n\n> general asks to run notify", ("Yes, please.", True)),
        ("\n\n  no  \n-- \nAda Lovelace\nLondon", ("no", True)),
        ("Yes\nbut make it 50", ("Yes", False)),
        ("", ("", True)),
        ("yes" + " " * 100_000 + "x", ("", False)),  # one line far past the limit
        ("yes" + "\n" * 100_000 + "x", ("yes", True)),  # read no further than its bound
        ("yes" + " " * 30_000, ("", False)),  # a line that runs past what is read
    ],
)
def test_the_answer_line_is_the_first_and_says_whether_it_stands_alone(
    text: str, expected: tuple[str, bool]
) -> None:
    assert answer_line(text) == expected


def test_a_line_at_the_limit_is_read_and_one_past_it_is_not() -> None:
    assert answer_line("y" * ANSWER_LINE_CHARS)[0] == "y" * ANSWER_LINE_CHARS
    assert answer_line("y" * (ANSWER_LINE_CHARS + 1))[0] == ""


@pytest.mark.parametrize(
    ("line", "bare", "numbered"),
    [
        ("Yes, please.", True, None),
        ("No!", True, None),
        ("yes thanks", True, None),
        ("Yes, but make it for two.", False, None),
        ("yes 12", False, "12"),
        ("No #7, it is wrong", False, "7"),
        ("yesterday 12", False, None),
        # The owner's own language: German, French, Spanish, Italian, Dutch.
        ("Ja, bitte.", True, None),
        ("Nein, danke!", True, None),
        ("Oui merci", True, None),
        ("Sí", True, None),
        ("nee", True, None),
        ("ja 12", False, "12"),
        ("Nein #3.", False, "3"),
        # Words of those languages with a number then more: a sentence, not an answer.
        ("Si 10 minutos no bastan, cancela la reunión.", False, None),
        ("Ja 2 Sachen noch: bitte erst morgen.", False, None),
        ("Jawohl", False, None),
        ("Ja, aber erst morgen.", False, None),
    ],
)
def test_approval_answers(line: str, bare: bool, numbered: str | None) -> None:
    assert (_MAIL_BARE_ANSWER.fullmatch(line) is not None) is bare
    match = _MAIL_ANSWER.match(line) or _MAIL_ANSWER_ALONE.fullmatch(line)
    assert (match[2] if match else None) == numbered


@pytest.mark.parametrize(
    ("line", "answer"),
    [
        ("Approve.", ("approve", None)),
        ("deny", ("deny", None)),
        ("yes ABCD-2345", ("yes", "ABCD-2345")),
        ("no problem", None),
        ("yes maybe", None),
        ("approve them all, and the others too", None),
        ("Ja.", ("ja", None)),
        ("nein ABCD-2345", ("nein", "ABCD-2345")),
        ("ja gerne", None),
    ],
)
def test_pairing_answers(line: str, answer: tuple[str, str | None] | None) -> None:
    match = _MAIL_PAIRING_ANSWER.fullmatch(line)
    assert (None if match is None else (match[1].lower(), match[2])) == answer


def test_what_could_disguise_shown_arguments_is_written_as_its_escape() -> None:
    """An approval's arguments as the owner reads them: a right-to-left override, a C1
    control, a variation selector and a zero-width space are escapes; words in any script
    stay as they are."""
    from butlers.text import escaped_disguises

    shown = escaped_disguises('{"to": "Zoë 東京 10\u202e0000 a\u0085b c\ufe0fd e\u200bf"}')
    assert shown == '{"to": "Zoë 東京 10\\u202e0000 a\\u0085b c\\ufe0fd e\\u200bf"}'
