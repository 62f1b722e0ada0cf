"""butlers.media's checks on the files people send: the type read from the bytes (never the
name), the byte caps, the count; and the hostile cases (a program named photo.jpg, a text that
starts like an image, a truncated header, an empty file).

The sample files are made here, byte by byte, as their formats define them (no binary test data
in the repository); other tests import them (`png`, `jpeg`, `ogg_opus`, ...).
"""

from __future__ import annotations

import base64
import struct
import zlib

import pytest

from butlers.errors import AttachmentRefused
from butlers.media import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    Attachment,
    audio_seconds,
    check_count,
    checked,
    clock_length,
    from_wire,
    sniff,
)

MB = 1024 * 1024


# -- sample files ------------------------------------------------------------------------------


def png(width: int = 1, height: int = 1, *, padding: int = 0) -> bytes:
    """A valid RGB PNG (red); `padding` bytes of an ancillary chunk make it as large as needed."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    rows = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    extra = chunk(b"tEXt", b"Comment\x00" + b"x" * padding) if padding else b""
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + extra
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


def jpeg(width: int = 8, height: int = 8) -> bytes:
    """A valid baseline JPEG: one 8x8 grey block (DC and AC tables of one code each); other
    sizes are declared by its frame header (a decoder would make that many pixels)."""

    def segment(marker: int, data: bytes) -> bytes:
        return struct.pack(">BBH", 0xFF, marker, len(data) + 2) + data

    return (
        b"\xff\xd8"
        + segment(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00")
        + segment(0xDB, b"\x00" + bytes([1] * 64))  # quantisation table 0: all ones
        + segment(0xC0, struct.pack(">BHHB", 8, height, width, 1) + b"\x01\x11\x00")  # grey
        + segment(0xC4, b"\x00" + bytes([1] + [0] * 15) + b"\x00")  # DC: "0" -> category 0
        + segment(0xC4, b"\x10" + bytes([1] + [0] * 15) + b"\x00")  # AC: "0" -> end of block
        + segment(0xDA, b"\x01\x01\x00\x00\x3f\x00")
        + b"\x3f"  # DC 0, end of block, padded with ones
        + b"\xff\xd9"
    )


def png_bomb(width: int, height: int) -> bytes:
    """A valid greyscale PNG of zeros: `width` x `height` pixels in a few hundred KB (16383
    square: 254 KB, 268 megapixels once decoded)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    packer, row = zlib.compressobj(9), b"\x00" * (width + 1)
    rows = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
        + chunk(b"IDAT", rows)
        + chunk(b"IEND", b"")
    )


# The classic 1x1 GIF and a 1x1 lossless WebP (both valid, widely used as feature probes).
GIF = base64.b64decode("R0lGODlhAQABAIAAAP///wAAACH5BAEAAAAALAAAAAABAAEAAAICRAEAOw==")
WEBP = base64.b64decode("UklGRhoAAABXRUJQVlA4TA0AAAAvAAAAEAcQERGIiP4HAA==")


def pdf(text: str = "Hello") -> bytes:
    """A valid one-page PDF (its cross-reference table's offsets computed)."""
    stream = f"BT /F1 12 Tf 20 20 Td ({text}) Tj ET".encode()
    objects = [
        b"<</Type/Catalog/Pages 2 0 R>>",
        b"<</Type/Pages/Kids[3 0 R]/Count 1>>",
        b"<</Type/Page/Parent 2 0 R/MediaBox[0 0 200 50]/Contents 4 0 R"
        b"/Resources<</Font<</F1 5 0 R>>>>>>",
        b"<</Length %d>>stream\n" % len(stream) + stream + b"\nendstream",
        b"<</Type/Font/Subtype/Type1/BaseFont/Helvetica>>",
    ]
    out = b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n"
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<</Size %d/Root 1 0 R>>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return out


def ogg_page(
    packet: bytes, *, sequence: int = 0, flags: int = 0x02, serial: int = 1, more: tuple = ()
) -> bytes:
    """One Ogg page holding one packet (and `more`), its CRC computed (Ogg's polynomial,
    unreflected). Its granule position says 0: a length the pages declare is not read."""
    packets = (packet, *more)
    lacing = [n for p in packets for n in [255] * (len(p) // 255) + [len(p) % 255]]
    header = (
        b"OggS\x00"
        + bytes([flags])
        + struct.pack("<qIII", 0, serial, sequence, 0)
        + bytes([len(lacing)])
        + bytes(lacing)
    )
    page = header + b"".join(packets)
    crc = 0
    for byte in page:
        crc ^= byte << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7 if crc & 0x80000000 else crc << 1) & 0xFFFFFFFF
    return page[:22] + struct.pack("<I", crc) + page[26:]


def ogg_opus(serial: int = 1) -> bytes:
    """The head of an Ogg/Opus stream, as a Telegram voice note starts: OpusHead, OpusTags."""
    head = b"OpusHead" + bytes([1, 1]) + struct.pack("<HIhB", 312, 48000, 0, 0)
    tags = b"OpusTags" + struct.pack("<I", 7) + b"butlers" + struct.pack("<I", 0)
    return ogg_page(head, serial=serial) + ogg_page(tags, sequence=1, flags=0, serial=serial)


def ogg_opus_playing(seconds: float, serial: int = 1) -> bytes:
    """An Ogg Opus file whose packets play `seconds` (each 120 ms: six 20 ms CELT frames,
    code 3, no bytes of sound), 250 to a page."""
    packet = bytes([31 << 3 | 3, 6])
    count = round(seconds / 0.12)
    pages = [
        ogg_page(
            packet,
            sequence=2 + n,
            flags=0,
            serial=serial,
            more=(packet,) * (min(250, count - i) - 1),
        )
        for n, i in enumerate(range(0, count, 250))
    ]
    return ogg_opus(serial) + b"".join(pages)


def wav(samples: int = 800) -> bytes:
    """A valid PCM WAV file of silence (8 kHz, 16 bit, mono)."""
    fmt = struct.pack("<HHIIHH", 1, 1, 8000, 16000, 2, 16)
    data = b"\x00\x00" * samples
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def mp3() -> bytes:
    """An ID3v2.4 tag (empty) and one MPEG-1 Layer III frame (128 kbit/s, 44.1 kHz)."""
    return b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\xff\xfb\x90\x64" + b"\x00" * 413


def m4a() -> bytes:
    """The head of an M4A file (the "M4A " brand), as the iPhone's voice memos start."""
    ftyp = b"ftypM4A " + b"\x00\x00\x00\x00" + b"M4A isommp42"
    return struct.pack(">I", 8 + len(ftyp)) + ftyp + struct.pack(">I", 8) + b"free"


def mp4_video() -> bytes:
    """The head of an MP4 video (the "isom" brand)."""
    ftyp = b"ftypisom" + b"\x00\x00\x02\x00" + b"isomiso2avc1mp41"
    return struct.pack(">I", 8 + len(ftyp)) + ftyp + struct.pack(">I", 8) + b"free"


# A Windows program's head ("MZ", the DOS stub) and a ZIP (an Office document, a jar).
EXE = b"MZ\x90\x00\x03\x00\x00\x00\x04\x00\x00\x00\xff\xff\x00\x00" + b"\x00" * 100
ZIP = b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + b"\x00" * 60


# -- sniff -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (jpeg(), "image/jpeg"),
        (png(), "image/png"),
        (GIF, "image/gif"),
        (WEBP, "image/webp"),
        (pdf(), "application/pdf"),
        (ogg_opus(), "audio/ogg"),
        (ogg_page(b"\x01vorbis" + b"\x00" * 22), "audio/ogg"),
        (mp3(), "audio/mpeg"),
        (b"\xff\xfb\x90\x64" + b"\x00" * 413, "audio/mpeg"),  # a bare frame, no tag
        (m4a(), "audio/mp4"),
        (wav(), "audio/wav"),
        ("Blood pressure 120/80\nweight 75 kg, all fine ✓\n".encode(), "text/plain"),
        (b"date,mg\r\n2026-11-01,5\r\n", "text/plain"),
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_sniff_reads_the_type_from_the_bytes(data: bytes, expected: str) -> None:
    assert sniff(data) == expected


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(EXE, id="exe"),
        pytest.param(ZIP, id="zip"),
        pytest.param(mp4_video(), id="mp4-video"),
        pytest.param(ogg_page(b"\x80theora" + b"\x00" * 34), id="ogg-video"),
        pytest.param(b"\x89PN", id="png-truncated"),
        pytest.param(b"\x89PNG\r\n\x1a", id="png-signature-cut"),
        pytest.param(b"OggS\x00\x02" + b"\x00" * 8, id="ogg-header-cut"),
        pytest.param(b"\xff\xd8", id="jpeg-marker-cut"),
        pytest.param("café".encode("latin-1") + b"\x00\x01", id="binary-junk"),
        pytest.param(b"\x01\x02\x03\x04\x05 mostly control characters", id="control-chars"),
        pytest.param("hello".encode("utf-16"), id="utf16-has-nul"),
        pytest.param(b"line one\x00line two", id="text-with-nul"),
        pytest.param(b"a" * 200_000 + b"\x00", id="long-text-nul-at-the-end"),
        pytest.param(b"a" * 200_000 + b"\xff", id="long-text-not-utf8-at-the-end"),
    ],
)
def test_sniff_reads_nothing_else(data: bytes) -> None:
    assert sniff(data) is None


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"GIF89a is the header I meant\n", id="gif-magic"),
        pytest.param(b"ID3 tags are in my mp3s\n", id="id3-magic"),
        pytest.param(b"%PDF or not, this is a note\n", id="pdf-without-version"),
        pytest.param(b"RIFF1234WAVEfmt is how a wav starts\n", id="wav-magic"),
        pytest.param(b"OggS", id="ogg-magic-alone"),
        pytest.param(b"%PDF-", id="pdf-header-cut"),
        pytest.param(b"<html><body><script>alert(1)</script></body></html>\n", id="html"),
    ],
)
def test_a_text_that_starts_like_a_file_format_is_text(data: bytes) -> None:
    """Real images and audio always hold bytes no text has: a readable text is a text file,
    whatever its first bytes claim (so it is never handed on as an image or for
    transcription)."""
    assert sniff(data) == "text/plain"


# -- checked -----------------------------------------------------------------------------------


def test_a_photo_within_the_limits_is_an_attachment() -> None:
    data = jpeg()
    attachment = checked(data, "IMG_0001.jpg", max_bytes=MB)
    assert attachment == Attachment("IMG_0001.jpg", "image/jpeg", data)
    assert attachment.kind == "image"


def test_the_type_comes_from_the_bytes_not_the_name() -> None:
    """A PNG named x.pdf is an image; a PDF named notes.txt is a PDF."""
    assert checked(png(), "x.pdf", max_bytes=MB).mime_type == "image/png"
    assert checked(pdf(), "notes.txt", max_bytes=MB).kind == "pdf"
    assert checked(ogg_opus(), "voice", max_bytes=MB).kind == "audio"


@pytest.mark.parametrize(
    "name", ["photo.jpg", "scan.pdf", "voice.ogg", "notes.txt", "photo.jpg.exe", "../../etc/x.png"]
)
def test_a_program_is_refused_whatever_its_name(name: str) -> None:
    with pytest.raises(AttachmentRefused) as refused:
        checked(EXE, name, max_bytes=MB)
    shown = name.rsplit("/", 1)[-1]
    assert str(refused.value) == (
        f"{shown!r} is not a photo, PDF, text file or voice note, so I cannot read it"
    )


def test_a_file_over_the_cap_is_refused_naming_file_and_limit() -> None:
    data = pdf() + b"%" * int(12.3 * MB)
    with pytest.raises(AttachmentRefused) as refused:
        checked(data, "scan.pdf", max_bytes=10 * MB)
    assert str(refused.value) == "'scan.pdf' is 12.3 MB; the most I can read is 10.0 MB"


def test_the_cap_is_exact() -> None:
    """At the cap a file is read; one byte more is refused, in bytes (both would read the
    same rounded)."""
    at_cap = b"a" * 2000
    assert checked(at_cap, "a.txt", max_bytes=2000).size == 2000
    with pytest.raises(AttachmentRefused) as refused:
        checked(at_cap + b"a", "a.txt", max_bytes=2000)
    assert str(refused.value) == "'a.txt' is 2,001 bytes; the most I can read is 2,000 bytes"


def test_an_image_over_the_model_s_image_limit_is_refused() -> None:
    """The channel's cap may be higher (Telegram's is 20 MB): the Messages API reads images of
    5 MB at most."""
    data = png(padding=MAX_IMAGE_BYTES)
    assert len(data) > MAX_IMAGE_BYTES
    with pytest.raises(AttachmentRefused) as refused:
        checked(data, "big.png", max_bytes=20 * MB)
    assert str(refused.value) == (  # in bytes: both read "5.0 MB"
        "'big.png' is 5,242,969 bytes; the most I can read of a photo is 5,242,880 bytes"
    )
    # The same number of bytes as a PDF (no such limit) is read.
    assert checked(pdf() + b"%" * MAX_IMAGE_BYTES, "big.pdf", max_bytes=20 * MB).kind == "pdf"


def gif(*, screen: tuple[int, int], frame: tuple[int, int]) -> bytes:
    """A GIF's logical screen and its first frame's descriptor, each of its own size."""
    descriptor = b"\x2c" + struct.pack("<HHHH", 0, 0, *frame) + b"\x00"
    return b"GIF89a" + struct.pack("<HH", *screen) + b"\x00\x00\x00" + descriptor + b"\x3b"


def webp_canvas(width: int, height: int) -> bytes:
    """An extended WebP's header (VP8X) declaring its canvas: what a decoder allocates."""
    vp8x = b"\x00" * 4 + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    body = b"WEBP" + b"VP8X" + struct.pack("<I", len(vp8x)) + vp8x
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_an_image_declaring_more_pixels_than_a_decoder_should_make_is_refused() -> None:
    """A decompression bomb: 254 KB that Claude Code would decode to 268 megapixels (1.37 GB
    of its memory, measured). Its header says so; nothing is decoded here."""
    bomb = png_bomb(16383, 16383)
    assert len(bomb) < 300 * 1024
    with pytest.raises(AttachmentRefused) as refused:
        checked(bomb, "receipt.png", max_bytes=20 * MB)
    assert str(refused.value) == (
        "'receipt.png' is 16383x16383 pixels; the most I can read of a photo is 50 megapixels"
    )
    # Each image type read here: its header's size is what counts.
    for data, name in [
        (jpeg(10_000, 6_000), "a.jpg"),
        # (imagesize reads a GIF's size as signed: past 32767 it "does not say", refused too)
        (gif(screen=(30000, 30000), frame=(1, 1)), "a.gif"),
        # A decoder grows a small screen to fit its first frame (libnsgif): 28 bytes.
        (gif(screen=(1, 1), frame=(16383, 16383)), "grows.gif"),
        (webp_canvas(8_000, 8_000), "a.webp"),
    ]:
        with pytest.raises(AttachmentRefused, match=r"pixels; the most I can read of a photo"):
            checked(data, name, max_bytes=MB)
    assert MAX_IMAGE_PIXELS == 50_000_000


def test_a_large_phone_photo_is_read() -> None:
    """A 48-megapixel phone photo's size (8064x6048) is within the limit."""
    assert checked(jpeg(8064, 6048), "IMG_0002.jpg", max_bytes=MB).kind == "image"
    assert checked(webp_canvas(7000, 7000), "a.webp", max_bytes=MB).kind == "image"


def test_an_image_whose_header_does_not_say_its_size_is_refused() -> None:
    """A JPEG whose segments never reach a frame header: a decoder would have to guess."""
    comments = b"\xff\xd8" + b"\xff\xfe\x00\x02" * 1000
    assert sniff(comments) == "image/jpeg"
    with pytest.raises(AttachmentRefused) as refused:
        checked(comments, "odd.jpg", max_bytes=MB)
    assert str(refused.value) == "'odd.jpg' does not say its size in pixels, so I cannot read it"


def test_how_long_audio_plays_is_read_from_its_packets_or_header() -> None:
    """An Ogg Opus voice note by its packets (the length its pages or Telegram declare is the
    sender's to write); a WAV by its header; what cannot be told is None."""
    assert audio_seconds(ogg_opus()) == 0
    assert audio_seconds(ogg_opus_playing(61.2)) == pytest.approx(61.2)
    assert audio_seconds(ogg_opus_playing(16 * 60)) == pytest.approx(960)
    # Past `beyond` it stops counting: some length over it (a crafted 20 MiB: 3.9 s of CPU).
    stopped = audio_seconds(ogg_opus_playing(16 * 60), beyond=600)
    assert stopped is not None and 600 < stopped < 960
    # A chained stream (another serial) plays on after the first: counted too.
    chained = ogg_opus_playing(30) + ogg_opus_playing(45, serial=2)
    assert audio_seconds(chained) == pytest.approx(75)
    assert audio_seconds(wav(8000)) == pytest.approx(1.0)
    assert audio_seconds(b"OggS" + b"\x00" * 40) is None  # no page: no length
    # Junk between pages is skipped, as a decoder skips it, and the length its last page
    # declares is never taken instead (one junk byte hid 20 minutes: a review).
    head, long = ogg_opus(), ogg_opus_playing(20 * 60)
    assert (audio_seconds(head + b"\x00" + long[len(head) :], beyond=900) or 0) > 900
    # A page whose CRC is wrong (libogg drops it) claiming the real pages as one unfinished
    # packet of its own: dropped here too, the pages behind it counted (it measured 0 s).
    audio = ogg_opus_playing(1200)[len(head) :]
    fake = b"OggS\x00\x01" + struct.pack("<qIII", 0, 1, 99, 0xDEADBEEF) + bytes([255] * 256)
    crafted = head + fake + audio + b"\0" * (255 * 255 - len(audio))
    assert (audio_seconds(crafted, beyond=900) or 0) > 900
    # An Opus file with a second stream that is not Opus: not measured, so not transcribed.
    vorbis = ogg_page(b"\x01vorbis" + b"\x00" * 22, serial=2)
    assert audio_seconds(ogg_opus_playing(30) + vorbis) is None
    assert audio_seconds(b"RIFF" + b"\xff" * 60) is None
    assert (clock_length(61.2), clock_length(960), clock_length(8 * 3600 + 5)) == (
        "1:01",
        "16:00",
        "8:00:05",
    )


def test_an_empty_file_is_refused() -> None:
    with pytest.raises(AttachmentRefused, match=r"^'empty.txt' is empty, so I cannot read it$"):
        checked(b"", "empty.txt", max_bytes=MB)


def test_a_hostile_name_is_cleaned_before_it_is_shown() -> None:
    """Path parts, control and direction characters go; the name is bounded."""
    attachment = checked(png(), "..\\..\\evil\u202egpj.exe\x1b[31m", max_bytes=MB)
    assert "/" not in attachment.name and "\\" not in attachment.name
    assert "\u202e" not in attachment.name and "\x1b" not in attachment.name
    assert len(checked(png(), "n" * 10_000 + ".png", max_bytes=MB).name) == 120
    with pytest.raises(AttachmentRefused) as refused:
        checked(EXE, "\u202eexe.jpg", max_bytes=MB)
    assert "\u202e" not in str(refused.value)


def test_check_count() -> None:
    check_count(5, 5)
    with pytest.raises(AttachmentRefused) as refused:
        check_count(6, 5)
    assert str(refused.value) == "This message has 6 files; I read at most 5 files a message"
    with pytest.raises(AttachmentRefused, match=r"at most 1 file a message$"):
        check_count(2, 1)


def test_the_wire_form_round_trips() -> None:
    attachment = checked(pdf(), "scan.pdf", max_bytes=MB)
    assert from_wire([attachment.to_wire()]) == [attachment]
