"""A fake Telegram Bot API on loopback, enough for python-telegram-bot: getMe, setWebhook,
deleteWebhook and getWebhookInfo (the registered `webhook_url`, as Telegram keeps it),
getUpdates (long poll, offsets acknowledge; every call's offset and the update ids it returned
are recorded; only the kinds of update in its `allowed_updates` are returned, the others are
dropped), sendMessage (recorded; can answer 429, or 400 for good).

As Telegram does, an update below the offset a getUpdates call was given is never returned by
it, also when it was pushed while that call was waiting; an update pushed twice (a
redelivery) is returned twice. And as Telegram does with two pollers of one token, a
getUpdates arriving while another still waits ends the waiting one with 409 Conflict
(counted in `conflicts`, unless the waiting one's client had gone: a poller that died).

Inline keyboards: `push_press` queues a callback_query (a press of a button of one of the
bot's messages); answerCallbackQuery and editMessageText are recorded (`press_answers`,
`edits`).

Files: `push_voice`, `push_audio`, `push_photo` (several sizes), `push_document` and
`push_sticker` queue a message carrying a file the fake keeps; getFile answers its file_path
and file_size (the size it reports may be a lie, or left out: `reported_size`), and
`/file/bot<token>/<file_path>` serves its bytes (`fail_downloads`: the next N downloads answer
502). Each getFile and download is recorded (`file_requests`, `downloads`). sendPhoto and
sendDocument (multipart) are recorded with the bytes, file name, caption and chat
(`sent_files`)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tests.fakes import serve_on_loopback

# A 1x1 PNG: a real image for the default photo.
TINY_PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
    "1f15c4890000000d49444154789c6360000002000154a24f0a0000000049454e44ae426082"
)


class FakeBotAPI:
    def __init__(self, token: str = "123456:TEST-TOKEN") -> None:
        self.token = token
        self.pending: list[dict[str, Any]] = []
        self.sent: list[dict[str, Any]] = []
        self.sent_at: list[float] = []  # when each sendMessage arrived (time.monotonic)
        self.calls: list[str] = []
        self.fail_next_sends_with_429 = 0
        # While set, sendMessage answers 400 (what Telegram says for a chat it cannot write to).
        self.fail_sends_with_400 = False
        self.refused_sends: list[dict[str, Any]] = []  # what a 400 refused
        # The Bot API "down": sendMessage answers 502 Bad Gateway while this is set.
        self.sends_down = False
        # sendDocument answers the next N calls 502; sendPhoto refuses every photo with 400
        # (what Telegram says of a picture it will not show, e.g. 1x5000) while this is set.
        self.fail_next_documents = 0
        self.refuse_photos = False
        self.down_sends = 0  # sendMessage calls answered 502
        # Hold every sendMessage (after recording it in send_attempts) until release_sends().
        self.hold_sends = False
        self._released_sends = asyncio.Event()
        self.send_attempts: list[dict[str, Any]] = []  # every sendMessage, as it arrived
        self.sent_params: list[dict[str, Any]] = []  # every delivered sendMessage, all params
        self._sent_ids: list[int] = []
        self.chat_actions: list[dict[str, Any]] = []  # sendChatAction calls ("typing")
        # One entry per getUpdates call: the offset it asked with (None: none given), and the
        # update_ids it returned (None while it is still waiting).
        self.polls: list[dict[str, Any]] = []
        self.conflicts = 0  # getUpdates calls that overlapped a live one (two pollers)
        self._waiting_poll: tuple[asyncio.Event, web.Request] | None = None
        self._update_ids = itertools.count(1000)
        self._message_ids = itertools.count(1)
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._closing = False
        self.url = ""
        self.webhooks: list[dict[str, Any]] = []  # setWebhook calls, with their parameters
        self.webhook_url = ""  # what getWebhookInfo says: the last setWebhook's, until deleted
        self.press_answers: list[dict[str, Any]] = []  # answerCallbackQuery calls
        self.edits: list[dict[str, Any]] = []  # editMessageText calls
        self.edits_down = False  # while set, editMessageText answers 502 Bad Gateway
        self.down_edits = 0  # editMessageText calls answered 502
        self._sent_by_id: dict[int, dict[str, Any]] = {}  # message id -> its sendMessage params
        self._query_ids = itertools.count(5000)
        # Files a pushed message carries: file_id -> {"data", "file_path", "reported_size"}.
        self.files: dict[str, dict[str, Any]] = {}
        self._file_ids = itertools.count(1)
        self.file_requests: list[str] = []  # the file_id of every getFile call
        self.downloads: list[str] = []  # the file_path of every download, answered or not
        self.download_delay_s = 0.0  # how long each download takes
        self.downloading = 0  # downloads under way now, and the most at once so far
        self.most_downloading = 0
        self.fail_downloads = 0  # the next N downloads answer 502 Bad Gateway
        self.fail_after = 0  # ... once this many downloads were asked for
        self.sent_files: list[dict[str, Any]] = []  # sendPhoto / sendDocument calls

    # -- what the test does -----------------------------------------------------------------

    def _message(self, chat_id: int, **fields: Any) -> dict[str, Any]:
        return {
            "message_id": next(self._message_ids),
            "date": int(time.time()),
            "chat": {"id": chat_id, "type": "private", "first_name": "Ada"},
            "from": {"id": chat_id, "is_bot": False, "first_name": "Ada", "last_name": "L"},
            **fields,
        }

    async def push(self, update: dict[str, Any]) -> int:
        [update_id] = await self.push_batch(update)
        return update_id

    async def push_batch(self, *updates: dict[str, Any]) -> list[int]:
        """Queue several updates at once: one getUpdates call returns them all. The same
        update given twice is delivered twice, as a redelivery would be."""
        for update in updates:
            update.setdefault("update_id", next(self._update_ids))
        async with self._changed:
            self.pending.extend(updates)
            self._changed.notify_all()
        return [u["update_id"] for u in updates]

    def text_update(self, chat_id: int, text: str) -> dict[str, Any]:
        """An update carrying a text message, with a fresh update_id; not queued."""
        return {"update_id": next(self._update_ids), "message": self._message(chat_id, text=text)}

    async def push_text(self, chat_id: int, text: str, *, reply_to: int | None = None) -> int:
        """A text message; `reply_to`: the id of the bot's message it answers (as a person's
        reply in the app)."""
        fields: dict[str, Any] = {"text": text}
        if reply_to is not None:
            bot = self.bot_user()
            fields["reply_to_message"] = {
                "message_id": reply_to,
                "date": int(time.time()),
                "chat": {"id": chat_id, "type": "private", "first_name": "Ada"},
                "from": bot,
                "text": self._sent_by_id.get(reply_to, {}).get("text", "(ours)"),
            }
        return await self.push({"message": self._message(chat_id, **fields)})

    @property
    def bot_id(self) -> int:
        """The bot's user id: as Telegram's, the token's first part."""
        return int(self.token.split(":", 1)[0])

    def bot_user(self) -> dict[str, Any]:
        """The bot as a message's `from`."""
        return {"id": self.bot_id, "is_bot": True, "first_name": "Butler"}

    def sent_message_ids(self) -> list[int]:
        """The message ids the bot's sends were given, in order (a person may reply to one)."""
        return list(self._sent_ids)

    def sent_with_buttons(self) -> list[tuple[int, dict[str, Any]]]:
        """(message id, sendMessage params) of every sent message that had an inline keyboard."""
        return [(i, p) for i, p in self._sent_by_id.items() if p.get("reply_markup")]

    async def push_press(
        self, chat_id: int, message_id: int, data: str, *, from_id: int | None = None
    ) -> str:
        """A press of a button with `data` under the bot's message `message_id`, in chat
        `chat_id` (by `from_id`, default: that chat's person); the callback query's id."""
        query_id = str(next(self._query_ids))
        sent = self._sent_by_id.get(message_id, {})
        message = {
            "message_id": message_id,
            "date": int(time.time()),
            "chat": {"id": chat_id, "type": "private", "first_name": "Ada"},
            "from": self.bot_user(),
            "text": str(sent.get("text", "(a message)")),
        }
        presser = from_id if from_id is not None else chat_id
        await self.push(
            {
                "callback_query": {
                    "id": query_id,
                    "from": {"id": presser, "is_bot": False, "first_name": "Ada"},
                    "message": message,
                    "chat_instance": "1",
                    "data": data,
                }
            }
        )
        return query_id

    def answer_to(self, query_id: str) -> dict[str, Any] | None:
        """The answerCallbackQuery call for `query_id`, once it came."""
        return next((a for a in self.press_answers if a["callback_query_id"] == query_id), None)

    def add_file(
        self, data: bytes, file_path: str, *, reported_size: int | str | None = "true"
    ) -> dict[str, Any]:
        """Keep a file for getFile and download; its file_id, file_unique_id and file_size as
        a message's file object carries them. `reported_size`: what getFile and the message
        say its size is ("true": its real size; None: nothing)."""
        number = next(self._file_ids)
        file_id = f"file-{number}"
        size = len(data) if reported_size == "true" else reported_size
        self.files[file_id] = {
            "data": data,
            "file_path": f"{file_path.rsplit('.', 1)[0]}_{number}.{file_path.rsplit('.', 1)[-1]}",
            "reported_size": size,
        }
        described: dict[str, Any] = {"file_id": file_id, "file_unique_id": f"u-{number}"}
        if size is not None:
            described["file_size"] = size
        return described

    def _with_caption(self, fields: dict[str, Any], caption: str | None) -> dict[str, Any]:
        return {**fields, "caption": caption} if caption is not None else fields

    async def push_voice(
        self,
        chat_id: int,
        data: bytes,
        *,
        caption: str | None = None,
        reported_size: int | str | None = "true",
        duration: int = 3,
    ) -> int:
        """A voice note (Telegram records them as OGG/Opus), `duration` seconds long."""
        voice = {
            **self.add_file(data, "voice/file.oga", reported_size=reported_size),
            "duration": duration,
            "mime_type": "audio/ogg",
        }
        return await self.push(
            {"message": self._message(chat_id, **self._with_caption({"voice": voice}, caption))}
        )

    async def push_audio(
        self, chat_id: int, data: bytes, file_name: str, mime_type: str = "audio/mpeg"
    ) -> int:
        """An audio file sent as music (message.audio)."""
        audio = {
            **self.add_file(data, "music/file.mp3"),
            "duration": 3,
            "file_name": file_name,
            "mime_type": mime_type,
        }
        return await self.push({"message": self._message(chat_id, audio=audio)})

    async def push_photo(
        self,
        chat_id: int,
        sizes: list[tuple[bytes, int, int]] | None = None,
        *,
        caption: str | None = None,
        reported_sizes: list[int | str | None] | None = None,
    ) -> int:
        """A photo, as Telegram sends one: the same picture in several sizes, smallest first
        ((bytes, width, height) each; default: one 1x1 PNG). `reported_sizes`: the file_size
        each size claims (default: the truth)."""
        sizes = sizes if sizes is not None else [(TINY_PNG, 1, 1)]
        reported = reported_sizes or ["true"] * len(sizes)
        photo = [
            {
                **self.add_file(data, "photos/file.jpg", reported_size=claim),
                "width": width,
                "height": height,
            }
            for (data, width, height), claim in zip(sizes, reported, strict=True)
        ]
        return await self.push(
            {"message": self._message(chat_id, **self._with_caption({"photo": photo}, caption))}
        )

    async def push_album(
        self,
        chat_id: int,
        photos: list[bytes | None],
        *,
        caption: str | None = None,
        together: bool = True,
    ) -> list[int]:
        """An album: the photos sent together, as Telegram sends them, a message each with one
        media_group_id and the caption on the first; None: a video there (not read). `together`:
        in one getUpdates answer; else one update a poll, each pushed once the one before was
        acknowledged (taken)."""
        group = f"album-{next(self._file_ids)}"
        updates = []
        for n, data in enumerate(photos):
            item: dict[str, Any]
            if data is None:
                video = {"file_id": f"video-{n}", "file_unique_id": f"video-u{n}", "duration": 2}
                item = {"video": {**video, "width": 64, "height": 64}}
            else:
                photo = [{**self.add_file(data, "photos/file.jpg"), "width": 64, "height": 64}]
                item = {"photo": photo}
            fields = self._with_caption(item, caption if n == 0 else None)
            updates.append({"message": self._message(chat_id, media_group_id=group, **fields)})
        if together:
            return await self.push_batch(*updates)
        ids = []
        for update in updates:
            ids.append(await self.push(update))
            await self.wait_until(lambda: self.acknowledged(ids[-1]))
        return ids

    async def push_document(
        self,
        chat_id: int,
        data: bytes,
        file_name: str,
        mime_type: str,
        *,
        caption: str | None = None,
        reported_size: int | str | None = "true",
    ) -> int:
        """A file sent as a document: its name and type are the sender's word."""
        document = {
            **self.add_file(data, "documents/file.bin", reported_size=reported_size),
            "file_name": file_name,
            "mime_type": mime_type,
        }
        fields = self._with_caption({"document": document}, caption)
        return await self.push({"message": self._message(chat_id, **fields)})

    async def push_sticker(self, chat_id: int) -> int:
        """A sticker: a file of a kind the bot does not read (nothing is served for it)."""
        sticker = {
            "file_id": "sticker-1",
            "file_unique_id": "sticker-u1",
            "type": "regular",
            "width": 512,
            "height": 512,
            "is_animated": False,
            "is_video": False,
        }
        return await self.push({"message": self._message(chat_id, sticker=sticker)})

    async def push_edit(self, chat_id: int, text: str) -> int:
        return await self.push(
            {"edited_message": {**self._message(chat_id, text=text), "edit_date": 1}}
        )

    async def wait_attempts(self, count: int, timeout_s: float = 60) -> list[dict[str, Any]]:
        """Until `count` sendMessage calls have arrived (delivered, refused, down or held)."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: len(self.send_attempts) >= count)
        return self.send_attempts

    async def wait_sent(self, count: int, timeout_s: float = 60) -> list[dict[str, Any]]:
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: len(self.sent) >= count)
        return self.sent

    async def wait_until(self, condition: Callable[[], bool], timeout_s: float = 60) -> None:
        """Until `condition()` holds; it is checked whenever a call arrives or is answered."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(condition)

    def deliveries(self, update_id: int) -> int:
        """How many getUpdates answers carried `update_id`."""
        return sum((p["returned"] or []).count(update_id) for p in self.polls)

    def acknowledged(self, update_id: int) -> bool:
        """Whether a getUpdates call has asked with an offset past `update_id` (which tells
        Telegram it may forget the update)."""
        return any(p["offset"] is not None and p["offset"] > update_id for p in self.polls)

    # -- the API ----------------------------------------------------------------------------

    async def _params(self, request: web.Request) -> dict[str, Any]:
        if request.content_type == "application/json":
            return await request.json()
        form = await request.post()
        params: dict[str, Any] = {}
        for key, value in form.items():
            try:
                params[key] = json.loads(value) if isinstance(value, str) else value
            except json.JSONDecodeError:
                params[key] = value
        return params

    async def _method(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return web.json_response(
                {"ok": False, "error_code": 401, "description": "Unauthorized"}, status=401
            )
        method = request.match_info["method"]
        params = await self._params(request)
        async with self._changed:
            self.calls.append(method)
            self._changed.notify_all()
        handler = getattr(self, f"_api_{method}", None)
        if handler is None:
            return web.json_response(
                {"ok": False, "error_code": 404, "description": f"{method} not faked"}, status=404
            )
        if method == "getUpdates":
            return await self._api_getUpdates(params, request)
        return await handler(params)

    async def _api_getMe(self, params: dict[str, Any]) -> web.Response:
        return web.json_response(
            {
                "ok": True,
                "result": {
                    "id": self.bot_id,
                    "is_bot": True,
                    "first_name": "Butler",
                    "username": "butler_bot",
                    "can_join_groups": True,
                    "can_read_all_group_messages": False,
                    "supports_inline_queries": False,
                },
            }
        )

    async def _api_deleteWebhook(self, params: dict[str, Any]) -> web.Response:
        self.webhook_url = ""
        return web.json_response({"ok": True, "result": True})

    async def _api_getWebhookInfo(self, params: dict[str, Any]) -> web.Response:
        info = {"url": self.webhook_url, "has_custom_certificate": False}
        return web.json_response({"ok": True, "result": {**info, "pending_update_count": 0}})

    async def _api_sendChatAction(self, params: dict[str, Any]) -> web.Response:
        async with self._changed:
            self.chat_actions.append(params)
            self._changed.notify_all()
        return web.json_response({"ok": True, "result": True})

    async def _api_answerCallbackQuery(self, params: dict[str, Any]) -> web.Response:
        async with self._changed:
            self.press_answers.append(
                {**params, "callback_query_id": str(params["callback_query_id"])}
            )
            self._changed.notify_all()
        return web.json_response({"ok": True, "result": True})

    async def _api_editMessageText(self, params: dict[str, Any]) -> web.Response:
        if self.edits_down:
            async with self._changed:
                self.down_edits += 1
                self._changed.notify_all()
            return web.json_response(
                {"ok": False, "error_code": 502, "description": "Bad Gateway"}, status=502
            )
        message_id = int(params["message_id"])
        async with self._changed:
            self.edits.append(params)
            self._changed.notify_all()
        message = self._message(int(params["chat_id"]), text=str(params["text"]))
        message["message_id"] = message_id
        message["from"] = self.bot_user()
        return web.json_response({"ok": True, "result": message})

    async def _api_getFile(self, params: dict[str, Any]) -> web.Response:
        file_id = str(params.get("file_id"))
        async with self._changed:
            self.file_requests.append(file_id)
            self._changed.notify_all()
        kept = self.files.get(file_id)
        if kept is None:
            return web.json_response(
                {"ok": False, "error_code": 400, "description": "Bad Request: invalid file_id"},
                status=400,
            )
        result: dict[str, Any] = {
            "file_id": file_id,
            "file_unique_id": f"u-{file_id}",
            "file_path": kept["file_path"],
        }
        if kept["reported_size"] is not None:
            result["file_size"] = kept["reported_size"]
        return web.json_response({"ok": True, "result": result})

    async def _download(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return web.Response(status=401, text="Unauthorized")
        path = request.match_info["path"]
        async with self._changed:
            self.downloads.append(path)
            self._changed.notify_all()
        self.downloading += 1
        self.most_downloading = max(self.most_downloading, self.downloading)
        try:
            await asyncio.sleep(self.download_delay_s)
        finally:
            self.downloading -= 1
        if self.fail_downloads and len(self.downloads) > self.fail_after:
            self.fail_downloads -= 1
            return web.json_response(
                {"ok": False, "error_code": 502, "description": "Bad Gateway"}, status=502
            )
        kept = next((f for f in self.files.values() if f["file_path"] == path), None)
        if kept is None:
            return web.json_response(
                {"ok": False, "error_code": 404, "description": "Not Found"}, status=404
            )
        return web.Response(body=kept["data"], content_type="application/octet-stream")

    async def _api_sendPhoto(self, params: dict[str, Any]) -> web.Response:
        return await self._send_file("photo", params)

    async def _api_sendDocument(self, params: dict[str, Any]) -> web.Response:
        return await self._send_file("document", params)

    async def _send_file(self, kind: str, params: dict[str, Any]) -> web.Response:
        """sendPhoto / sendDocument: the file is a multipart part named `kind` (or one that
        `attach://<name>` names)."""
        if kind == "document" and self.fail_next_documents:
            self.fail_next_documents -= 1
            return web.json_response(
                {"ok": False, "error_code": 502, "description": "Bad Gateway"}, status=502
            )
        if kind == "photo" and self.refuse_photos:
            return web.json_response(
                {
                    "ok": False,
                    "error_code": 400,
                    "description": "Bad Request: PHOTO_INVALID_DIMENSIONS",
                },
                status=400,
            )
        upload = params.get(kind)
        if isinstance(upload, str) and upload.startswith("attach://"):
            upload = params.get(upload.removeprefix("attach://"))
        if not isinstance(upload, web.FileField):
            return web.json_response(
                {"ok": False, "error_code": 400, "description": f"Bad Request: no {kind} file"},
                status=400,
            )
        if not str(params.get("chat_id", "")).lstrip("-").isdigit():
            return web.json_response(
                {"ok": False, "error_code": 400, "description": "Bad Request: chat not found"},
                status=400,
            )
        chat_id = int(params["chat_id"])
        caption = params.get("caption")
        message = self._message(chat_id)
        message["from"] = self.bot_user()
        if kind == "photo":
            message["photo"] = [{"file_id": "p", "file_unique_id": "p", "width": 1, "height": 1}]
        else:
            message["document"] = {"file_id": "d", "file_unique_id": "d"}
        if caption is not None:
            message["caption"] = str(caption)
        record = {
            "method": f"send{kind.title()}",
            "chat_id": chat_id,
            "data": upload.file.read(),
            "filename": upload.filename,
            "caption": None if caption is None else str(caption),
            "message_id": message["message_id"],
            "params": {k: v for k, v in params.items() if not isinstance(v, web.FileField)},
        }
        async with self._changed:
            self._sent_ids.append(message["message_id"])
            self.sent_files.append(record)
            self._changed.notify_all()
        return web.json_response({"ok": True, "result": message})

    async def _api_setWebhook(self, params: dict[str, Any]) -> web.Response:
        self.webhooks.append(params)
        self.webhook_url = str(params.get("url", ""))
        return web.json_response({"ok": True, "result": True})

    async def _api_getUpdates(self, params: dict[str, Any], request: web.Request) -> web.Response:
        given = params.get("offset")
        offset = int(given or 0)
        timeout = float(params.get("timeout") or 0)
        poll: dict[str, Any] = {"offset": None if given is None else int(given), "returned": None}
        poll["at"] = time.monotonic()
        superseded = asyncio.Event()

        def acknowledge() -> None:  # an offset acknowledges every update before it, for good
            self.pending = [u for u in self.pending if u["update_id"] >= offset]

        async with self._changed:
            if self._waiting_poll is not None:
                earlier, earlier_request = self._waiting_poll
                transport = earlier_request.transport
                if transport is not None and not transport.is_closing():
                    self.conflicts += 1
                earlier.set()
            self._waiting_poll = (superseded, request)
            self.polls.append(poll)
            self._changed.notify_all()
            acknowledge()
            if not self.pending and timeout:
                try:
                    async with asyncio.timeout(timeout):
                        await self._changed.wait_for(
                            lambda: bool(self.pending) or self._closing or superseded.is_set()
                        )
                except TimeoutError:
                    pass
                acknowledge()  # what came meanwhile may be below the offset: never returned
            if self._waiting_poll is not None and self._waiting_poll[0] is superseded:
                self._waiting_poll = None
            if superseded.is_set():
                poll["returned"] = []
                return web.json_response(
                    {
                        "ok": False,
                        "error_code": 409,
                        "description": "Conflict: terminated by other getUpdates request; "
                        "make sure that only one bot instance is running",
                    },
                    status=409,
                )
            # As Telegram: only the kinds of update asked for (`allowed_updates`) come; the
            # others are dropped.
            allowed = params.get("allowed_updates")
            if allowed is not None:
                self.pending = [u for u in self.pending if any(k in u for k in allowed)]
            result = list(self.pending)
            poll["returned"] = [u["update_id"] for u in result]
            self._changed.notify_all()
        return web.json_response({"ok": True, "result": result})

    def release_sends(self) -> None:
        self.hold_sends = False
        self._released_sends.set()

    async def _api_sendMessage(self, params: dict[str, Any]) -> web.Response:
        async with self._changed:
            self.send_attempts.append(params)
            self._changed.notify_all()
        if self.hold_sends:
            await self._released_sends.wait()
        if self.sends_down:
            self.down_sends += 1
            return web.json_response(
                {"ok": False, "error_code": 502, "description": "Bad Gateway"}, status=502
            )
        if self.fail_sends_with_400:
            async with self._changed:
                self.refused_sends.append({"chat_id": params["chat_id"], "text": params["text"]})
                self._changed.notify_all()
            return web.json_response(
                {"ok": False, "error_code": 400, "description": "Bad Request: chat not found"},
                status=400,
            )
        if self.fail_next_sends_with_429:
            self.fail_next_sends_with_429 -= 1
            return web.json_response(
                {
                    "ok": False,
                    "error_code": 429,
                    "description": "Too Many Requests: retry after 1",
                    "parameters": {"retry_after": 1},
                },
                status=429,
            )
        chat_id = int(params["chat_id"])
        message = self._message(chat_id, text=str(params["text"]))
        message["from"] = self.bot_user()
        self._sent_ids.append(message["message_id"])
        self._sent_by_id[message["message_id"]] = params
        async with self._changed:
            self.sent.append({"chat_id": chat_id, "text": str(params["text"])})
            self.sent_params.append(params)
            self.sent_at.append(time.monotonic())
            self._changed.notify_all()
        return web.json_response({"ok": True, "result": message})

    async def start(self) -> None:
        await self.start_on(0)

    async def start_on(self, port: int) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # sendPhoto/sendDocument
        app.router.add_route("*", "/bot{token}/{method}", self._method)
        app.router.add_route("GET", "/file/bot{token}/{path:.+}", self._download)
        self._runner, self.url = await serve_on_loopback(app, port)

    async def stop(self) -> None:
        async with self._changed:  # end open long polls now rather than at their timeout
            self._closing = True
            self._changed.notify_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
