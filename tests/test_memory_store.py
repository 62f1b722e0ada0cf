"""A butler's long-term memory store (butlers.memory) on a real PostgreSQL: full-text search
with word forms, trigram misspellings, forget, the privacy rule, bounds and eviction."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from butlers.db import create_pool
from butlers.memory import MemoryStore, Viewer
from butlers.tool_errors import ToolRefusal


@pytest.fixture
async def memory(
    pg_server, make_database: Callable[..., Awaitable[str]]
) -> AsyncIterator[MemoryStore]:
    pool = await create_pool(pg_server, await make_database(), max_size=2)
    store = MemoryStore(pool, language="english")
    await store.open()
    try:
        yield store
    finally:
        await pool.close()


async def test_search_finds_the_right_fact_first_word_forms_included(memory: MemoryStore) -> None:
    await memory.remember("The car's winter tyre pressure is 2.4 bar", ["car"])
    await memory.remember("My dentist is Dr. Okafor on Mill Street", [])
    await memory.remember("Anna's birthday is on 3 March", ["family"])
    found = await memory.search("tyres")
    assert [f["text"] for f in found] == ["The car's winter tyre pressure is 2.4 bar"]
    assert found[0]["tags"] == ["car"] and found[0]["score"] > 0
    found = await memory.search("when is Anna's birthday?")
    assert found[0]["text"] == "Anna's birthday is on 3 March"


async def test_misspellings_through_trigrams(memory: MemoryStore) -> None:
    assert memory.trigrams, "the embedded PostgreSQL ships pg_trgm"
    await memory.remember("My dentist is Dr. Okafor on Mill Street", [])
    await memory.remember("The car's winter tyre pressure is 2.4 bar", [])
    found = await memory.search("Okafer")
    assert found and found[0]["text"].startswith("My dentist")


async def test_forget_removes_it(memory: MemoryStore) -> None:
    kept = await memory.remember("Parking spot is B12", [])
    gone = await memory.remember("Parking permit expires in May", [])
    assert await memory.forget(gone["id"])
    assert [f["id"] for f in await memory.search("parking")] == [kept["id"]]
    assert not await memory.forget(gone["id"])


async def test_private_memories_stay_in_their_conversation(memory: MemoryStore) -> None:
    await memory.remember("Door code is 4711", ["private"], conversation="telegram:1")
    await memory.remember("Door colour is green", [], conversation="telegram:1")
    other = Viewer(conversation="telegram:2")
    own = Viewer(conversation="telegram:1")
    assert [f["text"] for f in await memory.search("door", viewer=other)] == [
        "Door colour is green"
    ]
    assert len(await memory.search("door", viewer=own)) == 2
    assert len(await memory.search("door")) == 2  # the operator sees everything
    private = (await memory.search("door code", viewer=own))[0]
    assert not await memory.forget(private["id"], viewer=other)
    assert await memory.forget(private["id"], viewer=own)


async def test_bad_input_is_refused_with_the_reason(memory: MemoryStore) -> None:
    with pytest.raises(ToolRefusal, match="4096"):
        await memory.remember("x" * 5000, [])
    with pytest.raises(ToolRefusal, match="empty"):
        await memory.remember("   ", [])
    with pytest.raises(ToolRefusal, match="empty"):
        await memory.search(" ")
    with pytest.raises(ToolRefusal, match="limit"):
        await memory.search("x", limit=0)
    assert await memory.count() == 0
    # NUL and a query of operators only do not break the search.
    await memory.remember("tab\x00le", [])
    assert await memory.search('" - or ""') == []


async def test_the_oldest_unused_memory_is_evicted(
    memory: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    memory.max_memories = 3
    first = await memory.remember("alpha fact", [])
    second = await memory.remember("beta fact", [])
    await memory.remember("gamma fact", [])
    await memory.search("alpha")  # used: now newer than beta
    await memory.remember("delta fact", [])
    ids = {f["id"] for f in await memory.search("fact")}
    assert first["id"] in ids and second["id"] not in ids and len(ids) == 3
    assert f"evicted the oldest unused: {second['id']}" in caplog.text


async def test_an_unknown_language_falls_back_to_simple(
    pg_server, make_database: Callable[..., Awaitable[str]]
) -> None:
    pool = await create_pool(pg_server, await make_database(), max_size=1)
    try:
        store = MemoryStore(pool, language="klingon")
        await store.open()
        assert store.language == "simple"
        await store.remember("tyre pressure", [])
        assert await store.search("tyre")
        # The same rows re-stemmed for english when the language changes.
        english = MemoryStore(pool, language="english")
        await english.open()
        assert await english.search("tyres")
    finally:
        await pool.close()


async def test_at_ten_thousand_memories_the_oldest_unused_is_evicted(
    memory: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    assert memory.max_memories == 10_000  # the default
    async with memory.pool.acquire() as conn:
        await conn.execute(
            """INSERT INTO memories (text, language, words, used_at)
               SELECT 'fact ' || n, 'english', to_tsvector('english', 'fact ' || n),
                      now() - (10000 - n) * interval '1 minute'
               FROM generate_series(1, 10000) AS n"""
        )
        oldest = await conn.fetchval("SELECT id FROM memories WHERE text = 'fact 1'")
    await memory.search("fact 1")  # 'fact 1' used now; 'fact 2' is the oldest unused
    kept = await memory.remember("the newest fact", [])
    assert await memory.count() == 10_000
    async with memory.pool.acquire() as conn:
        left = {
            r["text"]
            for r in await conn.fetch("SELECT text FROM memories WHERE id <= $1 + 2", oldest)
        }
    assert "fact 1" in left and "fact 2" not in left and "fact 3" in left
    assert kept["text"] == "the newest fact"
    assert "evicted the oldest unused" in caplog.text
