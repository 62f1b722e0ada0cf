"""Many conversations at once: `[switchboard] max_concurrent_messages = N` works on up to N
messages together, the messages of one conversation one at a time and in order; the
classifier's sessions are bounded by N. Real switchboard, real Claude Code sessions (the
classifier's and the butler's), a slow scripted model, the fake Bot API."""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path

from butlers.config import RuntimeConfig, SwitchboardConfig, TelegramConfig
from tests.conftest import StartButler, butler_config, free_port, write_butler_dir
from tests.fakes.bot_api import FakeBotAPI
from tests.fakes.messages_api import ScriptedMessagesAPI
from tests.test_inbox import is_classifier, model

CHATS = (5001, 5002, 5003, 5004)
MODEL_DELAY_S = 0.6  # each answer of the model: a message costs a few of them
MARK = re.compile(r"chat (\d+) says #(\d+)")


class Intervals:
    """When the model worked on which message: from each request's arrival to its answer."""

    def __init__(self, api: ScriptedMessagesAPI) -> None:
        self.requests: list[tuple[float, float, tuple[int, int], bool]] = []
        self._arrived: dict[int, float] = {}
        answer = model("general", {"general": "noted"})

        def arrived(body: dict) -> float:
            self._arrived[id(body)] = time.monotonic()
            return MODEL_DELAY_S

        def respond(body: dict) -> list[dict]:
            found = MARK.search(json.dumps(body["messages"][0]))
            if found:
                key = (int(found.group(1)), int(found.group(2)))
                start = self._arrived.pop(id(body), time.monotonic())
                self.requests.append((start, time.monotonic(), key, is_classifier(body)))
            return answer(body)

        api.delay_for = arrived
        api.respond_with(respond)

    def of_messages(self) -> dict[tuple[int, int], tuple[float, float]]:
        """Each message's span: its first request's arrival to its last one's answer."""
        spans: dict[tuple[int, int], tuple[float, float]] = {}
        for start, end, key, _ in self.requests:
            first, last = spans.get(key, (start, end))
            spans[key] = (min(first, start), max(last, end))
        return spans

    def classifier_peak(self) -> int:
        """The most classification sessions at once (each from its first request's arrival to
        its last answer)."""
        sessions: dict[tuple[int, int], tuple[float, float]] = {}
        for start, end, key, classifier in self.requests:
            if classifier:
                first, last = sessions.get(key, (start, end))
                sessions[key] = (min(first, start), max(last, end))
        events = sorted(
            [(s, 1) for s, _ in sessions.values()] + [(e, -1) for _, e in sessions.values()]
        )
        peak = current = 0
        for _, step in events:
            current += step
            peak = max(peak, current)
        return peak


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


async def test_four_at_once_each_chat_in_order(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
    db_conn,
) -> None:
    """8 messages from 4 chats, N = 4, the classifier deciding each: no two messages of one
    chat overlap (the second starts after the first's reply), and chats do overlap."""
    intervals = Intervals(scripted_api)
    config_dir = tmp_path / "config"
    general = await start_butler(
        butler_config(
            "general",
            runtime=RuntimeConfig(timeout_s=60, tick_interval_s=0, max_concurrent_sessions=4),
        )
    )
    write_butler_dir(config_dir, "general", general.port, description="Everything.")
    port = free_port()
    write_butler_dir(config_dir, "switchboard", port)
    switchboard = await start_butler(
        butler_config(
            "switchboard",
            port=port,
            telegram=TelegramConfig(
                allowed_chat_ids=tuple(map(str, CHATS)), api_base_url=bot_api.url
            ),
            switchboard=SwitchboardConfig(max_concurrent_messages=4),
        ),
        config_dir=config_dir,
    )
    await bot_api.push_batch(
        # A chat's two messages side by side: taking the oldest four would take both.
        *(bot_api.text_update(chat, f"chat {chat} says #{n}") for chat in CHATS for n in (1, 2))
    )
    sent = await bot_api.wait_sent(8, timeout_s=120)
    assert sorted(s["chat_id"] for s in sent) == sorted(CHATS * 2)

    spans = intervals.of_messages()
    assert set(spans) == {(chat, n) for chat in CHATS for n in (1, 2)}
    conn = await db_conn(switchboard.config.database)
    finished = {
        row["text"]: row["finished_at"]
        for row in await conn.fetch("SELECT text, finished_at FROM inbox WHERE status = 'done'")
    }
    assert len(finished) == 8
    for chat in CHATS:
        first, second = spans[(chat, 1)], spans[(chat, 2)]
        assert not overlap(first, second), f"chat {chat}: its two messages overlapped"
        assert first[1] <= second[0], f"chat {chat}: #2 started before #1"
        assert finished[f"chat {chat} says #1"] < finished[f"chat {chat} says #2"]
    firsts = [spans[(chat, 1)] for chat in CHATS]
    assert any(overlap(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1 :]), (
        "no two chats were worked on at once"
    )
    # Classifications ran side by side (not one at a time, as the switchboard's own
    # max_concurrent_sessions = 1 would have it), at most N.
    assert 2 <= intervals.classifier_peak() <= 4
    # One reply per message, each in its own chat, in the chat's order.
    for chat in CHATS:
        assert [s["text"] for s in sent if s["chat_id"] == chat] == ["noted", "noted"]


async def test_one_at_a_time_stays_the_default(
    start_butler: StartButler,
    tmp_path: Path,
    bot_api: FakeBotAPI,
    scripted_api: ScriptedMessagesAPI,
) -> None:
    """Without the setting (spec v1): one message at a time, in arrival order, whatever the
    chat."""
    intervals = Intervals(scripted_api)
    config_dir = tmp_path / "config"
    general = await start_butler(
        butler_config(
            "general",
            runtime=RuntimeConfig(timeout_s=60, tick_interval_s=0, max_concurrent_sessions=4),
        )
    )
    write_butler_dir(config_dir, "general", general.port, description="Everything.")
    port = free_port()
    write_butler_dir(config_dir, "switchboard", port)
    await start_butler(
        butler_config(
            "switchboard",
            port=port,
            telegram=TelegramConfig(
                allowed_chat_ids=tuple(map(str, CHATS[:3])), api_base_url=bot_api.url
            ),
        ),
        config_dir=config_dir,
    )
    await bot_api.push_batch(
        *(bot_api.text_update(chat, f"chat {chat} says #1") for chat in CHATS[:3])
    )
    await bot_api.wait_sent(3, timeout_s=120)
    spans = sorted(intervals.of_messages().items(), key=lambda item: item[1][0])
    assert [key for key, _ in spans] == [(chat, 1) for chat in CHATS[:3]]
    for (_, earlier), (_, later) in itertools.pairwise(spans):
        assert earlier[1] <= later[0]
    assert intervals.classifier_peak() == 1
