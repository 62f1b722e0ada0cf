"""Several switchboard processes on one database, part by part, on a real PostgreSQL: the
claim (one statement, per-conversation order, race-free), leases and their takeover (short
leases), the leader's advisory lock, and the LISTEN/NOTIFY wake-ups."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import asyncpg
import pytest

from butlers.config import SwitchboardConfig, TelegramConfig, TriageRule
from butlers.db import create_pool
from butlers.switchboard.inbox import InboxMessage, InboxStore, IncomingMessage
from butlers.switchboard.leadership import Leadership
from butlers.switchboard.process_name import ProcessName
from butlers.switchboard.wakeups import WakeupHandlers, Wakeups
from butlers.tasks import cancel_and_wait
from tests.conftest import WEBHOOK_SECRET, butler_config, eventually, free_port, log_records
from tests.fakes.messages_api import text
from tests.test_inbox import ask, model, start_fleet
from tests.test_telegram import CHAT as TELEGRAM_CHAT
from tests.test_telegram import answer_notes, notes_fleet
from tests.test_worker_failures import CHAT, TO_GENERAL
from tests.test_worker_failures import start_fleet as telegram_fleet

_ids = itertools.count(1)


@pytest.fixture
async def database(make_database, switchboard_template: str) -> str:
    return await make_database(switchboard_template)


@pytest.fixture
async def stores(pg_server, database: str) -> AsyncIterator[Callable[[], Awaitable[InboxStore]]]:
    """Inbox stores on pools of their own: what two switchboard processes have."""
    pools: list[asyncpg.Pool] = []

    async def make() -> InboxStore:
        pool = await create_pool(pg_server, database)
        pools.append(pool)
        return InboxStore(pool)

    yield make
    for pool in pools:
        await pool.close()


async def queue(store: InboxStore, conversation: str | None, text: str = "hi") -> int:
    inbox_id = await store.accept(
        IncomingMessage(
            "telegram", f"u{next(_ids)}", text, source_id="1", conversation=conversation
        ),
        None,
    )
    assert inbox_id is not None
    return inbox_id


async def settled(conn: asyncpg.Connection) -> bool:
    """Whether every message is finished and every outbox row sent or failed: from then on
    nothing more can reach a channel, so what it received is final (a duplicate, had there
    been one, is in it)."""
    return await conn.fetchval(
        """SELECT NOT EXISTS (SELECT 1 FROM inbox WHERE status IN ('queued', 'processing'))
              AND NOT EXISTS (SELECT 1 FROM outbox WHERE status IN ('pending', 'sending'))"""
    )


async def finish(store: InboxStore, inbox_id: int, replica: str) -> bool:
    return await store.finish(
        inbox_id, replica=replica, status="done", routed_to=None, reply="ok", error=None
    )


async def test_a_conversation_goes_one_at_a_time_in_order_across_processes(stores) -> None:
    a, b = await stores(), await stores()
    x1 = await queue(a, "telegram:1")
    x2 = await queue(a, "telegram:1")
    y1 = await queue(a, "telegram:2")
    loose = await queue(a, None)  # no conversation (an `ask`): in order with nobody
    first = await a.claim_next("a", 30)
    assert first is not None and first.id == x1
    # The other process does not take x2 while x1 is in flight: the next conversation's.
    second = await b.claim_next("b", 30)
    assert second is not None and second.id == y1
    third = await b.claim_next("b", 30)
    assert third is not None and third.id == loose
    assert await b.claim_next("b", 30) is None
    assert await finish(a, x1, "a")
    fourth = await b.claim_next("b", 30)
    assert fourth is not None and fourth.id == x2


async def test_claims_racing_from_two_processes_never_break_a_conversation(stores) -> None:
    """60 messages in 6 conversations, 8 workers in two processes claiming as fast as they
    can: every message once, never two of one conversation at once, each in its order."""
    a, b = await stores(), await stores()
    conversations = [f"telegram:{n}" for n in range(6)]
    expected: dict[str, list[int]] = {c: [] for c in conversations}
    for _ in range(60):
        conversation = random.choice(conversations)
        expected[conversation].append(await queue(a, conversation))
    in_flight: set[str] = set()
    done: dict[str, list[int]] = {c: [] for c in conversations}
    claimed: list[int] = []

    async def worker(store: InboxStore, replica: str) -> None:
        while len(claimed) < 60:  # until every message has been claimed (by some worker)
            message = await store.claim_next(replica, 30)
            if message is None:  # nothing claimable now: another worker holds what is left
                await asyncio.sleep(0.005)
                continue
            assert message.conversation not in in_flight, "two of one conversation at once"
            in_flight.add(message.conversation)
            claimed.append(message.id)
            await asyncio.sleep(random.random() / 200)
            in_flight.discard(message.conversation)
            done[message.conversation].append(message.id)
            assert await finish(store, message.id, replica)

    async with asyncio.timeout(60):  # until all 60 are done (a message never claimed: fails)
        await asyncio.gather(*(worker(s, r) for s, r in [(a, "a"), (b, "b")] * 4))
    assert sorted(claimed) == sorted(i for ids in expected.values() for i in ids)
    assert done == expected


async def taken_over(store: InboxStore, owner: str) -> InboxMessage:
    """The message `owner` claims once another owner's lease has run out: polled, as
    PostgreSQL's clock decides when that is (up to 30 s)."""
    claims: list[InboxMessage] = []

    async def claimed() -> bool:
        message = await store.claim_next(owner, 30)
        if message is not None:
            claims.append(message)
        return bool(claims)

    await eventually(claimed, timeout_s=30)
    [taken] = claims
    return taken


async def test_a_lease_that_runs_out_is_taken_over_and_fences_the_old_owner(stores) -> None:
    a, b = await stores(), await stores()
    inbox_id = await queue(a, "telegram:1")
    later = await queue(a, "telegram:1")
    message = await a.claim_next("a", 1)
    assert message is not None and message.attempts == 1
    assert await a.renew("a", [inbox_id], 1) == {inbox_id}
    assert await b.claim_next("b", 30) is None  # held, and its conversation's next waits
    # "a" died: nobody renews. "b" takes the message once the lease has run out (PostgreSQL's
    # clock decides; the test polls until it has).
    taken = await taken_over(b, "b")
    assert (taken.id, taken.attempts) == (inbox_id, 2)
    # The old owner hears it lost the message, and cannot finish it any more.
    assert await a.renew("a", [inbox_id], 1) == set()
    assert not await finish(a, inbox_id, "a")
    assert await finish(b, inbox_id, "b")
    assert (await b.claim_next("b", 30)).id == later


async def test_a_message_finished_here_is_not_lost_to_the_renewal(stores) -> None:
    """Guards InboxStore.renew: a message its process finished itself (its worker between
    that commit and letting go of the message) is still held, not lost; only another
    process's claim makes it lost, also once that process has finished it. Counted as lost,
    the worker's renewer cancelled the finished message's task: a false "lease was lost"
    in the log, and an `ask` waiting on it was never answered."""
    a, b = await stores(), await stores()
    mine = await queue(a, "telegram:1")
    theirs = await queue(a, "telegram:2")
    assert (await a.claim_next("a", 30)).id == mine
    assert await finish(a, mine, "a")
    assert await a.renew("a", [mine], 30) == {mine}
    assert (await a.claim_next("a", 1)).id == theirs  # "a" stalls: its lease runs out
    assert (await taken_over(b, "b")).id == theirs and await finish(b, theirs, "b")
    assert await a.renew("a", [mine, theirs], 30) == {mine}


async def test_a_restarted_process_resumes_its_own_messages_not_the_others(stores) -> None:
    a, b = await stores(), await stores()
    mine = await queue(a, "telegram:1")
    theirs = await queue(a, "telegram:2")
    assert (await a.claim_next("host:8100", 30)).id == mine
    assert (await b.claim_next("host:8101", 30)).id == theirs
    assert await a.requeue_interrupted(["host:8100"]) == 1  # "host:8100" started again
    assert (await a.get(mine))["status"] == "queued"
    assert (await a.get(theirs))["status"] == "processing"
    # A process stopping on purpose hands back what it was doing, attempt not counted.
    assert (await a.claim_next("host:8100", 30)).id == mine
    assert await a.release("host:8100", [mine]) == 1
    row = await a.get(mine)
    assert (row["status"], row["attempts"], row["claimed_by"]) == ("queued", 1, None)


async def test_a_restart_resumes_only_what_processes_of_its_name_that_are_gone_left(
    stores, pg_server, database: str
) -> None:
    """Two live processes named alike (two machines called `raspberrypi`): whichever
    restarts resumes what its own dead process left, never the live twin's message, in
    either order (a review: a name lock held by one let the other's restart take it)."""

    async def connect() -> asyncpg.Connection:
        return await asyncpg.connect(pg_server.dsn(database))

    store = await stores()
    a, b = ProcessName(connect, "raspberrypi:8100"), ProcessName(connect, "raspberrypi:8100")
    await a.open()
    await b.open()
    try:
        assert a.held and b.held and a.claimant != b.claimant
        as_a = await queue(store, "telegram:1")
        as_b = await queue(store, "telegram:2")
        assert (await store.claim_next(a.claimant, 30)).id == as_a
        assert (await store.claim_next(b.claimant, 30)).id == as_b
        for gone in (a, b):  # each in turn stops (its lock goes) and starts again
            await gone.close()
            again = ProcessName(connect, "raspberrypi:8100")
            await again.open()
            try:
                alive = b if gone is a else a
                assert await again.resumable(store) == [gone.claimant]
                assert alive.claimant not in await again.resumable(store)
            finally:
                await again.close()
            await gone.open()  # (the same claimant again, only for the next round)
    finally:
        await a.close()
        await b.close()


async def test_a_process_takes_its_claims_lock_again_when_its_connection_is_cut(
    pg_server, database: str
) -> None:
    """A database restart (here: the lock's backend terminated) lets the lock go: the
    process takes it again within seconds, or a restart of its name would take its
    messages under way while it lives (a review)."""
    from butlers.switchboard.process_name import lock_key

    async def connect() -> asyncpg.Connection:
        return await asyncpg.connect(pg_server.dsn(database))

    process = ProcessName(connect, "raspberrypi:8100")
    await process.open()
    admin = await connect()
    try:
        key = lock_key(process.claimant)
        assert not await admin.fetchval("SELECT pg_try_advisory_lock($1)", key)
        await admin.execute(
            """SELECT pg_terminate_backend(pid) FROM pg_locks
               WHERE locktype = 'advisory' AND granted AND database =
                     (SELECT oid FROM pg_database WHERE datname = current_database())"""
        )
        await eventually(lambda: _async(not process.held), timeout_s=10)
        await eventually(lambda: _async(process.held), timeout_s=20)
        assert not await admin.fetchval("SELECT pg_try_advisory_lock($1)", key)
    finally:
        await admin.close()
        await process.close()


class Duty:
    def __init__(self, name: str) -> None:
        self.name = name
        self.leading = False
        self.terms = 0

    async def lead(self) -> None:
        self.leading = True
        self.terms += 1

    async def step_down(self) -> None:
        self.leading = False


async def test_one_leader_and_another_takes_over_when_it_dies(pg_server, database: str) -> None:
    async def connect() -> asyncpg.Connection:
        return await asyncpg.connect(pg_server.dsn(database))

    duty_a, duty_b = Duty("poller-a"), Duty("poller-b")
    a = Leadership(connect, [duty_a], replica="a", retry_s=0.2, check_s=0.2)
    b = Leadership(connect, [duty_b], replica="b", retry_s=0.2, check_s=0.2)
    await a.open()
    await b.open()
    try:
        assert (a.is_leader, duty_a.leading) == (True, True)  # at once: a lone process leads
        tried = b.tries
        await eventually(lambda: _async(b.tries >= tried + 2), timeout_s=10)  # asked, refused
        assert (b.is_leader, duty_b.leading) == (False, False)
        # The leader's connection dies (its process was killed, its host lost).
        admin = await connect()
        try:
            await admin.execute(
                """SELECT pg_terminate_backend(pid) FROM pg_locks
                   WHERE locktype = 'advisory' AND granted AND database =
                         (SELECT oid FROM pg_database WHERE datname = current_database())"""
            )
        finally:
            await admin.close()

        async def b_leads() -> bool:
            return b.is_leader and duty_b.leading

        await eventually(b_leads, timeout_s=10)
        await eventually(lambda: _async(not duty_a.leading), timeout_s=5)
        # The old leader, back on a connection, waits as a follower now: it asks, is refused.
        tried = a.tries
        await eventually(lambda: _async(a.tries >= tried + 2), timeout_s=10)
        assert not a.is_leader and duty_a.terms == 1
        # The leader stops on purpose: the lock goes with it, the other leads again.
        await b.close()
        await eventually(lambda: _async(a.is_leader and duty_a.leading), timeout_s=10)
        assert duty_a.terms == 2 and not duty_b.leading
    finally:
        await a.close()
        await b.close()


async def _async(value: bool) -> bool:
    return value


async def test_notifications_wake_the_other_processes(stores, pg_server, database: str) -> None:
    store = await stores()
    queued = asyncio.Event()
    finished: list[int] = []
    outbox: list[str] = []
    wakeups = Wakeups(
        lambda: asyncpg.connect(pg_server.dsn(database)),
        WakeupHandlers(queued=queued.set, finished=finished.append, outbox=outbox.append),
    )
    await wakeups.open()
    try:
        await eventually(lambda: _async(wakeups.listening))
        queued.clear()
        inbox_id = await queue(store, "telegram:1")
        await asyncio.wait_for(queued.wait(), 5)
        assert (await store.claim_next("a", 30)).id == inbox_id
        assert await finish(store, inbox_id, "a")
        await eventually(lambda: _async(finished == [inbox_id]), timeout_s=5)
        async with store.pool.acquire() as conn:
            await conn.execute(
                "INSERT INTO outbox (kind, channel, recipient, text) "
                "VALUES ('reply', 'telegram', '1', 'x')"
            )
        await eventually(lambda: _async(outbox == ["telegram"]), timeout_s=5)
    finally:
        await wakeups.close()


async def test_an_ask_answered_by_another_process_reaches_its_caller(
    start_butler, tmp_path, scripted_api
) -> None:
    """`ask` waits in the process it was sent to; another process takes the message (this
    one's worker is stopped here, so the other must): the caller still gets the reply, told
    by PostgreSQL's notification."""
    scripted_api.respond_with(model("general", {"general": "From the other one."}))
    rule = TriageRule(butler="general", channel="mcp")
    first, _ = await start_fleet(start_butler, tmp_path, triage=[rule], names=("general",))
    other = await start_butler(
        butler_config("switchboard", port=free_port(), triage=(rule,)),
        config_dir=tmp_path / "config",
        database=first.config.database,
    )
    await other.switchboard.worker.close()  # it takes nothing: the first one must
    result = await ask(other, "hello there")
    assert (result["status"], result["reply"]) == ("done", "From the other one.")
    row = await first.switchboard.worker.inbox.get(result["inbox_id"])
    assert row["claimed_by"] == first.switchboard.worker.replica


async def test_webhooks_work_on_every_replica_and_the_leader_sends(
    start_butler, tmp_path, bot_api, scripted_api, db_conn
) -> None:
    """Telegram in webhook mode, two switchboard processes on one database: an update
    posted to either is stored (once, posted to both) and answered once, by the leader's
    outbox, also when the follower stored it."""
    scripted_api.respond_with(answer_notes)
    leader = await notes_fleet(start_butler, tmp_path, bot_api, mode="webhook")
    follower = await start_butler(
        butler_config(
            "switchboard",
            port=free_port(),
            telegram=TelegramConfig(
                mode="webhook", allowed_chat_ids=(str(TELEGRAM_CHAT),), api_base_url=bot_api.url
            ),
            triage=(TriageRule(butler="general", channel="telegram"),),
        ),
        config_dir=tmp_path / "config",
        database=leader.config.database,
    )
    assert leader.switchboard.leadership.is_leader
    assert not follower.switchboard.leadership.is_leader
    first = bot_api.text_update(TELEGRAM_CHAT, "note-1")
    second = bot_api.text_update(TELEGRAM_CHAT, "note-2")
    headers = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
    async with aiohttp.ClientSession() as session:
        for daemon, update in ((follower, first), (leader, first), (follower, second)):
            url = f"{daemon.base_url}/telegram/webhook"
            async with session.post(url, json=update, headers=headers) as response:
                assert response.status == 200
    sent = await bot_api.wait_sent(2)
    conn = await db_conn(leader.config.database)
    await eventually(lambda: settled(conn))  # nothing left that could still be sent
    assert [s["text"] for s in bot_api.sent] == ["noted 1", "noted 2"] == [s["text"] for s in sent]
    assert await conn.fetchval("SELECT count(*) FROM inbox") == 2


async def test_a_live_replica_that_lost_its_lease_answers_nothing(
    start_butler, tmp_path, bot_api, scripted_api, db_conn
) -> None:
    """Guards the fenced finish (inbox.finish on claimed_by, and the worker's rollback on
    LeaseLost): two switchboard processes on one database; the one working on a message stays
    alive but stops renewing its lease (a long pause), the other takes the message over once
    the lease has run out; then the first one finishes it (before the taker does). That
    finish is refused and rolled back (no outbox row of its own), and the person gets one
    answer, the taker's."""

    def answer(body: dict) -> list[dict]:  # which session's request: the first, or the taker's
        number = next(i for i, b in enumerate(scripted_api.requests) if b is body)
        return [text(f"answer {number}")]

    scripted_api.respond_with(answer)
    scripted_api.delay_for = lambda body: 120.0  # every session waits for release_held()
    # `general` runs one session at a time (the default): the taker's waits for the first's.
    first, _ = await telegram_fleet(start_butler, tmp_path, bot_api, lease_s=2)
    second = await start_butler(
        butler_config(
            "switchboard",
            port=free_port(),
            telegram=TelegramConfig(allowed_chat_ids=(str(CHAT),), api_base_url=bot_api.url),
            triage=(TO_GENERAL,),
            switchboard=SwitchboardConfig(message_lease_s=2),
        ),
        config_dir=tmp_path / "config",
        database=first.config.database,
    )
    workers = {d.switchboard.worker.replica: d.switchboard.worker for d in (first, second)}
    conn = await db_conn(first.config.database)
    await bot_api.push_text(CHAT, "hello")
    await scripted_api.wait_for_request(lambda body: True)  # whoever claimed it is routing it
    inbox_id, holder = await conn.fetchrow("SELECT id, claimed_by FROM inbox")
    loser = workers.pop(holder)
    [taker] = workers.values()
    with log_records("butlers.switchboard.worker") as records:
        # Alive, but its renewals stop: the lease runs out and the other process takes over.
        await cancel_and_wait(loser._renewer)

        async def taken_over() -> bool:
            owner = await conn.fetchval("SELECT claimed_by FROM inbox WHERE id = $1", inbox_id)
            return owner == taker.replica

        await eventually(taken_over)
        # The first session answers: its process finishes the message, while the taker's
        # session waits for general; that finish must be refused.
        await scripted_api.release_held()

        def dropped() -> bool:
            return any(
                r.getMessage().startswith(f"message {inbox_id} was taken over") for r in records
            )

        await eventually(lambda: _async(dropped()))
        await scripted_api.wait_for_request(lambda _: len(scripted_api.requests) == 2)
        await scripted_api.release_held()  # now the taker's session answers
        await eventually(lambda: settled(conn))
    assert bot_api.sent == [{"chat_id": CHAT, "text": "answer 1"}]
    outbox = await conn.fetch("SELECT inbox_id, text, status FROM outbox")
    assert [tuple(r) for r in outbox] == [(inbox_id, "answer 1", "sent")]
    row = await conn.fetchrow("SELECT * FROM inbox WHERE id = $1", inbox_id)
    assert (row["status"], row["reply"], row["claimed_by"], row["attempts"]) == (
        "done",
        "answer 1",
        taker.replica,
        2,
    )
