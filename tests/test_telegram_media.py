"""Telegram carries files: voice notes, audio, photos and documents in, photos and documents
out. The Telegram module runs on its own against the fake Bot API (python-telegram-bot over
loopback), handing what it stores to a RecordingWorker: what is tested is the channel (what
is downloaded, checked, refused, acknowledged, sent), not the inbox or the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

from butlers.config import SwitchboardConfig, TelegramConfig
from butlers.errors import DeliveryError
from butlers.media import Attachment
from butlers.modules.telegram import MAX_DOWNLOADS_AT_ONCE, TEXT_ONLY, TelegramModule
from butlers.switchboard.inbox import IncomingMessage
from butlers.switchboard.outbox import Delivery
from tests.conftest import WEBHOOK_SECRET, log_records
from tests.fakes.bot_api import TINY_PNG, FakeBotAPI
from tests.fakes.mail import RecordingWorker
from tests.test_media import png_bomb

CHAT = 12345
STRANGER = 999


def ogg_opus(payload: int = 200) -> bytes:
    """The start of an OGG/Opus stream, as Telegram records a voice note: a first page whose
    packet is the Opus header, then `payload` bytes of sound."""
    head = b"OpusHead" + bytes([1, 1]) + struct.pack("<HIhB", 312, 48000, 0, 0)
    page = b"OggS" + bytes([0, 2]) + bytes(8) + struct.pack("<I", 7) + bytes(8)
    return page + bytes([1, len(head)]) + head + bytes(range(256))[:payload]


def png(size: int) -> bytes:
    """A PNG's signature and header, padded to `size` bytes (its type is read from these)."""
    return (TINY_PNG + b"\x00" * size)[:size] if size >= len(TINY_PNG) else TINY_PNG


PDF = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n%%EOF\n"
EXE = b"MZ\x90\x00\x03\x00\x00\x00\x04\x00\x00\x00\xff\xff" + bytes(200)


@asynccontextmanager
async def telegram(
    bot_api: FakeBotAPI,
    worker: RecordingWorker,
    *,
    poll: bool = True,
    **options: object,
) -> AsyncIterator[TelegramModule]:
    """The Telegram module, connected to the fake Bot API, allowing CHAT; polling (as the
    switchboard's leader) unless `poll` is False. `options`: [modules.telegram] keys."""
    config = TelegramConfig(
        allowed_chat_ids=(str(CHAT),),
        api_base_url=bot_api.url,
        max_messages_per_s=0,
        **options,  # type: ignore[arg-type]
    )
    module = TelegramModule(config, bot_api.token, worker, webhook_secret=WEBHOOK_SECRET)  # type: ignore[arg-type]
    await module.open()
    await module._connected.wait()
    if poll:
        await module.lead()
    try:
        yield module
    finally:
        await module.close()


async def settled(bot_api: FakeBotAPI, update_id: int) -> None:
    """Until Telegram was told (by a getUpdates offset past it) that the update was taken."""
    await bot_api.wait_until(lambda: bot_api.acknowledged(update_id))


def only(worker: RecordingWorker) -> IncomingMessage:
    [message] = worker.accepted
    return message


# -- what comes in --------------------------------------------------------------------------


async def test_a_voice_note_is_handed_on_with_its_bytes_and_marked_voice(
    bot_api: FakeBotAPI,
) -> None:
    worker = RecordingWorker()
    voice = ogg_opus()
    async with telegram(bot_api, worker):
        update_id = await bot_api.push_voice(CHAT, voice)
        message = await worker.wait_for(str(update_id))
    assert (message.text, message.meta["voice"], message.source_id) == ("", True, str(CHAT))
    [attachment] = message.attachments
    assert (attachment.data, attachment.mime_type, attachment.kind) == (voice, "audio/ogg", "audio")
    assert bot_api.sent == []  # not transcribed here, not answered here


async def test_an_audio_file_and_a_captioned_document_keep_their_words(
    bot_api: FakeBotAPI,
) -> None:
    worker = RecordingWorker()
    mp3 = b"ID3\x04\x00\x00\x00\x00\x00\x00\xff\xfb\x90\x00" + bytes(300)
    async with telegram(bot_api, worker):
        audio_id = await bot_api.push_audio(CHAT, mp3, "memo.mp3")
        document_id = await bot_api.push_document(
            CHAT, PDF, "scan.pdf", "application/pdf", caption="my prescription"
        )
        audio = await worker.wait_for(str(audio_id))
        document = await worker.wait_for(str(document_id))
    assert audio.meta["voice"] is True and audio.attachments[0].data == mp3
    assert audio.attachments[0].name == "memo.mp3"
    assert document.text == "my prescription" and "voice" not in document.meta
    [pdf] = document.attachments
    assert (pdf.data, pdf.kind, pdf.name) == (PDF, "pdf", "scan.pdf")


async def test_a_photo_is_its_largest_size_within_the_cap(bot_api: FakeBotAPI) -> None:
    worker = RecordingWorker()
    small, medium, large = png(100), png(1500), png(5000)
    async with telegram(bot_api, worker, max_attachment_bytes=2000):
        update_id = await bot_api.push_photo(
            CHAT, [(small, 90, 90), (medium, 320, 320), (large, 1280, 1280)], caption="receipt"
        )
        message = await worker.wait_for(str(update_id))
    [photo] = message.attachments
    assert (message.text, photo.data, photo.mime_type) == ("receipt", medium, "image/png")
    [downloaded] = bot_api.downloads  # the large one was never fetched
    assert downloaded.startswith("photos/file_2")


async def test_an_albums_photos_are_handed_on_as_parts_of_one_album(bot_api: FakeBotAPI) -> None:
    """Telegram sends an album as a message per photo; each is stored as it comes (the inbox
    answers them as one), marked with the album. A lone photo is no album."""
    worker = RecordingWorker()
    photos = [png(100), png(200), png(300)]
    async with telegram(bot_api, worker):
        ids = await bot_api.push_album(CHAT, photos, caption="Which one?")
        lone = await bot_api.push_photo(CHAT, [(png(400), 9, 9)])
        parts = [await worker.wait_for(str(i)) for i in ids]
        single = await worker.wait_for(str(lone))
        await settled(bot_api, lone)
    assert [p.attachments[0].data for p in parts] == photos
    assert [p.text for p in parts] == ["Which one?", "", ""]
    assert len({p.album for p in parts}) == 1 and parts[0].album is not None
    # In one getUpdates answer: the first two know that more of their album follow.
    assert [p.album_more for p in parts] == [True, True, False]
    assert single.album is None and not single.album_more


async def test_an_albums_video_is_not_counted_as_more_to_come(bot_api: FakeBotAPI) -> None:
    """Photo, photo, video (what a phone's album often is): the video is not read, so the
    second photo is the album's last that will be stored and knows of no more."""
    worker = RecordingWorker()
    async with telegram(bot_api, worker):
        ids = await bot_api.push_album(CHAT, [png(100), png(200), None])
        parts = [await worker.wait_for(str(i)) for i in ids[:2]]
        await settled(bot_api, ids[2])
    assert [p.album_more for p in parts] == [True, False]
    assert len(worker.accepted) == 2


async def test_an_album_part_refused_once_downloaded_is_said_to_be_dropped(
    bot_api: FakeBotAPI,
) -> None:
    """Photo, then a "photo" whose bytes are a program: counted as coming (its stated type
    is a photo), so the first knew of more; refused once its bytes came, it is handed on as
    dropped (its album, no file), so the first need not wait the longer wait for it."""
    worker = RecordingWorker()
    async with telegram(bot_api, worker):
        ids = await bot_api.push_album(CHAT, [png(100), EXE])
        first = await worker.wait_for(str(ids[0]))
        await settled(bot_api, ids[1])
        [reply] = await bot_api.wait_sent(1)
    assert first.album_more  # it was told one more would come
    assert [m.external_id for m in worker.accepted] == [str(ids[0])]
    [dropped] = worker.dropped
    assert (dropped.external_id, dropped.album, dropped.attachments) == (
        str(ids[1]),
        first.album,
        (),
    )
    assert not dropped.album_more and dropped.conversation == first.conversation
    assert "cannot read it" in reply["text"]


async def test_an_album_that_comes_one_update_at_a_time_knows_of_no_more(
    bot_api: FakeBotAPI,
) -> None:
    worker = RecordingWorker()
    async with telegram(bot_api, worker):
        ids = await bot_api.push_album(CHAT, [png(100), png(200)], together=False)
        parts = [await worker.wait_for(str(i)) for i in ids]
    assert [p.album_more for p in parts] == [False, False]
    assert parts[0].album == parts[1].album is not None


async def test_a_photo_size_over_what_the_model_takes_is_passed_over(bot_api: FakeBotAPI) -> None:
    """The Messages API takes images of at most 5 MB: a larger size is not fetched (only to
    be refused) when a smaller one fits, whatever max_attachment_bytes allows."""
    worker = RecordingWorker()
    small, large = png(100), png(200)
    async with telegram(bot_api, worker):  # 20 MiB
        update_id = await bot_api.push_photo(
            CHAT, [(small, 90, 90), (large, 2560, 2560)], reported_sizes=[100, 6 * 1024 * 1024]
        )
        message = await worker.wait_for(str(update_id))
    assert message.attachments[0].data == small
    assert bot_api.downloads == ["photos/file_1.jpg"]


async def test_a_file_over_the_cap_is_refused_by_its_stated_size_before_downloading(
    bot_api: FakeBotAPI,
) -> None:
    worker = RecordingWorker()
    async with telegram(bot_api, worker, max_attachment_bytes=1000):
        update_id = await bot_api.push_document(CHAT, PDF + bytes(2000), "big.pdf", "x/y")
        await settled(bot_api, update_id)
        [reply] = await bot_api.wait_sent(1)
    assert reply == {
        "chat_id": CHAT,
        "text": "'big.pdf' is 2 KB; the most I can read is 1000 B",
    }
    assert worker.accepted == []
    assert bot_api.file_requests == [] and bot_api.downloads == []  # nothing fetched


@pytest.mark.parametrize("reported", [100, None], ids=["lying", "unstated"])
async def test_a_file_over_the_cap_is_refused_by_its_bytes_when_its_size_was_not_told(
    bot_api: FakeBotAPI, reported: int | None
) -> None:
    """A Bot API may state a smaller size, or none: the bytes that came are checked too."""
    worker = RecordingWorker()
    async with telegram(bot_api, worker, max_attachment_bytes=1000):
        update_id = await bot_api.push_document(
            CHAT, PDF + bytes(2000), "big.pdf", "application/pdf", reported_size=reported
        )
        await settled(bot_api, update_id)
        [reply] = await bot_api.wait_sent(1)
    assert reply["text"] == "'big.pdf' is 2 KB; the most I can read is 1000 B"
    assert worker.accepted == [] and len(bot_api.downloads) == 1


async def test_a_program_called_a_photo_is_refused(bot_api: FakeBotAPI) -> None:
    """The type is read from the bytes: the name and the type the sender declared say JPEG."""
    worker = RecordingWorker()
    async with telegram(bot_api, worker):
        update_id = await bot_api.push_document(CHAT, EXE, "photo.jpg", "image/jpeg")
        await settled(bot_api, update_id)
        [reply] = await bot_api.wait_sent(1)
    assert reply["text"] == (
        "'photo.jpg' is not a photo, PDF, text file or voice note, so I cannot read it"
    )
    assert worker.accepted == []


async def test_a_voice_note_longer_than_is_transcribed_is_refused_before_downloading(
    bot_api: FakeBotAPI,
) -> None:
    """Telegram states a note's length: eight hours (some 20 MiB of Opus) would be billed by
    the minute, or hold a local model for hours. Refused by that, with nothing fetched."""
    worker = RecordingWorker()
    async with telegram(bot_api, worker):
        update_id = await bot_api.push_voice(CHAT, ogg_opus(), duration=8 * 3600)
        await settled(bot_api, update_id)
        [reply] = await bot_api.wait_sent(1)
    assert reply["text"] == (
        "the voice note is 8:00:00 long; the most I transcribe is 15:00: send a shorter one, "
        "or write it out"
    )
    assert worker.accepted == [] and bot_api.downloads == []


async def test_a_decompression_bomb_sent_as_a_document_is_refused(bot_api: FakeBotAPI) -> None:
    """254 KB that would decode to 268 megapixels (1.37 GB of Claude Code's memory): the
    sender is told its size in pixels, and nothing reaches the inbox."""
    worker = RecordingWorker()
    async with telegram(bot_api, worker):
        update_id = await bot_api.push_document(
            CHAT, png_bomb(16383, 16383), "receipt.png", "image/png"
        )
        await settled(bot_api, update_id)
        [reply] = await bot_api.wait_sent(1)
    assert reply["text"] == (
        "'receipt.png' is 16383x16383 pixels; the most I can read of a photo is 50 megapixels"
    )
    assert worker.accepted == []


@pytest.fixture
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """An update that was not stored is fetched again after 0.05 s, not 1 s (what is under
    test is that it is, not the wait: the fast lane)."""
    from butlers import backoff
    from butlers.modules import telegram as telegram_module

    monkeypatch.setattr(telegram_module, "RECONNECT", backoff.Backoff((0.05,)))


async def test_a_download_that_fails_is_not_acknowledged_and_is_taken_when_it_comes_again(
    bot_api: FakeBotAPI, quick_retries: None
) -> None:
    worker = RecordingWorker()
    bot_api.fail_downloads = 1  # the Bot API's 502, once
    async with telegram(bot_api, worker):
        with log_records("butlers.modules.telegram") as records:
            update_id = await bot_api.push_document(CHAT, PDF, "scan.pdf", "application/pdf")
            message = await worker.wait_for(str(update_id))
            await settled(bot_api, update_id)
    assert message.attachments[0].data == PDF
    # A warning without a traceback: nothing is wrong that the next try does not mend.
    [deferred] = [r for r in records if "not handled" in r.getMessage()]
    assert deferred.levelname == "WARNING" and deferred.exc_info is None
    assert "not handled yet" in deferred.getMessage()
    assert len(bot_api.downloads) == 2  # the 502, then the bytes
    assert bot_api.deliveries(update_id) >= 2  # not acknowledged after the 502: sent again
    assert bot_api.sent == []  # nobody was told anything: nothing went wrong for them


async def test_a_file_that_never_downloads_is_given_up_and_the_chat_goes_on(
    bot_api: FakeBotAPI, quick_retries: None
) -> None:
    """Telegram hands updates over in order: a file whose download keeps failing would hold
    every later message of every chat. After `give_up_on_file_after_s` its sender is asked
    to send it again and the update is acknowledged; the next message is taken (review L2)."""
    worker = RecordingWorker()
    bot_api.fail_downloads = 10**6  # the file server stays down
    async with telegram(bot_api, worker) as module:
        module.give_up_on_file_after_s = 0.5
        update_id = await bot_api.push_document(CHAT, PDF, "scan.pdf", "application/pdf")
        [asked] = await bot_api.wait_sent(1)
        await settled(bot_api, update_id)
        later = await bot_api.push_text(CHAT, "did you get it?")
        message = await worker.wait_for(str(later))
    assert "scan.pdf" in asked["text"] and "send it again" in asked["text"]
    assert len(bot_api.downloads) >= 2  # tried again before giving up
    assert message.text == "did you get it?"
    assert [m.text for m in worker.accepted] == ["did you get it?"]


async def test_the_webhook_answers_503_when_a_download_fails_and_takes_the_update_again(
    bot_api: FakeBotAPI,
) -> None:
    worker = RecordingWorker()
    bot_api.fail_downloads = 1
    async with telegram(bot_api, worker, poll=False, mode="webhook") as module:
        update = {
            "update_id": 4242,
            "message": bot_api._message(
                CHAT,
                document={
                    **bot_api.add_file(PDF, "documents/file.pdf"),
                    "file_name": "scan.pdf",
                    "mime_type": "application/pdf",
                },
            ),
        }
        app = Starlette(routes=module.webhook_routes())
        headers = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sb") as client:
            first = await client.post("/telegram/webhook", json=update, headers=headers)
            assert (first.status_code, worker.accepted) == (503, [])
            again = await client.post("/telegram/webhook", json=update, headers=headers)
            assert again.status_code == 200
    assert only(worker).attachments[0].data == PDF


async def test_webhook_updates_fetch_a_few_files_at_a_time(bot_api: FakeBotAPI) -> None:
    """Telegram posts webhook updates over many connections at once, and each file is held
    in memory whole while it comes: at most MAX_DOWNLOADS_AT_ONCE are fetched together, the
    others wait their turn, and every one is taken."""
    worker = RecordingWorker()
    bot_api.download_delay_s = 0.2
    async with telegram(bot_api, worker, poll=False, mode="webhook") as module:
        app = Starlette(routes=module.webhook_routes())
        headers = {"X-Telegram-Bot-Api-Secret-Token": WEBHOOK_SECRET}
        transport = httpx.ASGITransport(app=app)

        async def post(index: int) -> int:
            document = {
                **bot_api.add_file(PDF, f"documents/file{index}.pdf"),
                "file_name": f"scan{index}.pdf",
                "mime_type": "application/pdf",
            }
            update = {
                "update_id": 5000 + index,
                "message": bot_api._message(CHAT, document=document),
            }
            async with httpx.AsyncClient(transport=transport, base_url="http://sb") as client:
                answer = await client.post("/telegram/webhook", json=update, headers=headers)
            return answer.status_code

        codes = await asyncio.gather(*(post(index) for index in range(10)))
    assert codes == [200] * 10 and len(worker.accepted) == 10
    assert bot_api.most_downloading == MAX_DOWNLOADS_AT_ONCE == 4


async def test_files_come_from_the_file_base_url(bot_api: FakeBotAPI) -> None:
    """[modules.telegram] file_base_url: the bytes are fetched there, not from api_base_url."""
    files = FakeBotAPI(token=bot_api.token)  # another server, holding the same file
    await files.start()
    try:
        bot_api.fail_downloads = 10**6  # a download from the Bot API itself would fail
        worker = RecordingWorker()
        async with telegram(bot_api, worker, file_base_url=f"{files.url}/file"):
            files.add_file(PDF, "documents/file.bin")
            update_id = await bot_api.push_document(CHAT, PDF, "scan.pdf", "application/pdf")
            message = await worker.wait_for(str(update_id))
    finally:
        await files.stop()
    assert message.attachments[0].data == PDF
    assert (bot_api.downloads, files.downloads) == ([], ["documents/file_1.bin"])


async def test_a_file_path_on_this_machine_is_never_read(
    bot_api: FakeBotAPI, tmp_path: Path
) -> None:
    """python-telegram-bot reads a getFile path that names a local file from the disk (a Bot
    API server in --local mode): a Bot API answering one must not get us to hand our own
    files to a butler."""
    secret = tmp_path / "secret.txt"
    secret.write_text("BUTLERS_AUTH_TOKEN=not-for-you\n")
    worker = RecordingWorker()
    described = bot_api.add_file(b"notes", "documents/file.txt")
    bot_api.files[described["file_id"]]["file_path"] = str(secret)
    document = {**described, "file_name": "notes.txt", "mime_type": "text/plain"}
    async with telegram(bot_api, worker):
        update_id = await bot_api.push({"message": bot_api._message(CHAT, document=document)})
        await settled(bot_api, update_id)
        [reply] = await bot_api.wait_sent(1)
    assert reply["text"] == "Telegram did not give me 'notes.txt' to download"
    assert worker.accepted == []


async def test_nothing_is_downloaded_for_a_stranger(bot_api: FakeBotAPI) -> None:
    worker = RecordingWorker()
    async with telegram(bot_api, worker):
        update_id = await bot_api.push_voice(STRANGER, ogg_opus())
        await settled(bot_api, update_id)
        [reply] = await bot_api.wait_sent(1)
    assert reply["chat_id"] == STRANGER and "private butler" in reply["text"]
    assert worker.accepted == [] and bot_api.file_requests == [] and bot_api.downloads == []


async def test_what_is_not_read_gets_the_sentence_saying_what_is(bot_api: FakeBotAPI) -> None:
    worker = RecordingWorker()
    async with telegram(bot_api, worker):
        update_id = await bot_api.push_sticker(CHAT)
        await settled(bot_api, update_id)
        [reply] = await bot_api.wait_sent(1)
    assert reply["text"] == TEXT_ONLY
    assert "voice notes, photos and documents" in TEXT_ONLY
    assert worker.accepted == [] and bot_api.file_requests == []


async def test_no_files_are_read_when_the_switchboard_reads_none(bot_api: FakeBotAPI) -> None:
    worker = RecordingWorker(limits=SwitchboardConfig(max_attachments_per_message=0))
    async with telegram(bot_api, worker):
        update_id = await bot_api.push_photo(CHAT)
        await settled(bot_api, update_id)
        [reply] = await bot_api.wait_sent(1)
    assert reply["text"] == "This message has 1 file; files are not read here"
    assert worker.accepted == [] and bot_api.file_requests == []


async def test_a_caption_goes_on_when_its_file_is_not_read(bot_api: FakeBotAPI) -> None:
    """The sender is told the file was not read, and the words they wrote with it still
    reach a butler, with a line saying what was not read (they were dropped with the file):
    refused by its stated size, by its bytes, a kind not read, or files not read at all."""
    worker = RecordingWorker()
    async with telegram(bot_api, worker, max_attachment_bytes=1000):
        big = await bot_api.push_document(
            CHAT, PDF + bytes(2000), "bill.pdf", "application/pdf", caption="Pay this Friday"
        )
        program = await bot_api.push_document(
            CHAT, EXE, "photo.jpg", "image/jpeg", reported_size=100, caption="Is this ok?"
        )
        [video, photo] = await bot_api.push_album(
            CHAT, [None, png(100)], caption="Which one for the card?"
        )
        accepted = {m: await worker.wait_for(str(m)) for m in (big, program, video, photo)}
        replies = await bot_api.wait_sent(3)
    assert accepted[big].text == (
        "Pay this Friday\n\n[not read: 'bill.pdf' is 2 KB; the most I can read is 1000 B]"
    )
    assert accepted[big].attachments == ()
    assert accepted[program].text == (
        "Is this ok?\n\n[not read: 'photo.jpg' is not a photo, PDF, text file or voice note, "
        "so I cannot read it]"
    )
    # The album's caption came on its video: it goes on, as the album's first part.
    assert accepted[video].text == "Which one for the card?\n\n[not read: a video]"
    assert accepted[video].album == accepted[photo].album is not None
    assert len(accepted[photo].attachments) == 1
    assert [r["text"] for r in replies] == [
        "'bill.pdf' is 2 KB; the most I can read is 1000 B",
        "'photo.jpg' is not a photo, PDF, text file or voice note, so I cannot read it",
        TEXT_ONLY,
    ]

    asked_for = len(bot_api.file_requests)
    worker = RecordingWorker(limits=SwitchboardConfig(max_attachments_per_message=0))
    async with telegram(bot_api, worker):
        update_id = await bot_api.push_photo(CHAT, caption="Dentist on Tuesday 3pm")
        message = await worker.wait_for(str(update_id))
    assert message.text == (
        "Dentist on Tuesday 3pm\n\n[not read: This message has 1 file; files are not read here]"
    )
    assert len(bot_api.file_requests) == asked_for  # nothing fetched


# -- what goes out --------------------------------------------------------------------------


def delivery(text: str, *attachments: Attachment, **meta: object) -> Delivery:
    return Delivery(
        id=1,
        kind="reply",
        channel="telegram",
        recipient=str(CHAT),
        text=text,
        meta=dict(meta),
        attempts=1,
        created_at=datetime.now(UTC),
        trace_context=None,
        inbox_id=None,
        butler="general",
        attachments=attachments,
    )


async def test_a_photo_and_a_document_are_sent_with_their_bytes_the_text_as_caption(
    bot_api: FakeBotAPI,
) -> None:
    picture = Attachment("chart.png", "image/png", png(3000))
    report = Attachment("Bericht für Mai.pdf", "application/pdf", PDF)
    async with telegram(bot_api, RecordingWorker(), poll=False) as module:
        ids = await module.deliver(delivery("Your week.", picture, report, reply_to_message_id=7))
    photo, document = bot_api.sent_files
    assert (photo["method"], photo["chat_id"], photo["data"], photo["caption"]) == (
        "sendPhoto",
        CHAT,
        picture.data,
        "Your week.",
    )
    assert (document["method"], document["data"], document["caption"]) == (
        "sendDocument",
        PDF,
        None,
    )
    assert document["filename"] == "Bericht für Mai.pdf"
    assert photo["params"]["reply_parameters"]["message_id"] == 7  # the first answers
    assert "reply_parameters" not in document["params"]
    assert ids == [str(photo["message_id"]), str(document["message_id"])]
    assert bot_api.sent == []  # the text went as the caption


async def test_a_text_too_long_for_a_caption_is_sent_first(bot_api: FakeBotAPI) -> None:
    text = "x" * 1025
    async with telegram(bot_api, RecordingWorker(), poll=False) as module:
        ids = await module.deliver(delivery(text, Attachment("a.pdf", "application/pdf", PDF)))
    [sent] = bot_api.sent
    [document] = bot_api.sent_files
    assert sent["text"] == text and document["caption"] is None
    assert ids == [str(i) for i in bot_api.sent_message_ids()]
    assert len(ids) == 2


async def test_a_file_telegram_refuses_is_final_and_a_bot_api_down_is_tried_again(
    bot_api: FakeBotAPI,
) -> None:
    """The same split as a text message's: a 400 is final, the network failing is not."""
    report = Attachment("a.pdf", "application/pdf", PDF)
    async with telegram(bot_api, RecordingWorker(), poll=False) as module:
        refused = dataclasses.replace(delivery("hi", report), recipient="not-a-chat")
        with pytest.raises(DeliveryError) as final:
            await module.deliver(refused)
        assert final.value.permanent
        await bot_api.stop()
        with pytest.raises(DeliveryError) as later:
            await module.deliver(delivery("hi", report))
        assert not later.value.permanent
