"""How much of a mail is read, at most: every bound, with what measured it. Whatever a sender
writes, reading it costs bounded time and memory (butlers.modules.mail_parse says how each
bound is kept); the channels (IMAP, the webhook) check the sizes before they parse."""

from __future__ import annotations

# A mail over its limit is not read (its envelope is kept as a failed inbox row). The limit is
# room for one attachment of `[modules.email] max_attachment_bytes` as base64 (4/3 of its
# bytes) and the rest of the mail, and never under MAX_MAIL_BYTES: a 10 MiB attachment came in
# a mail of ~13.6 MiB, which a fixed 10 MiB refused whole. Parsing costs ~10 times the mail's
# size in memory and about a second for each 10 MiB.
MAX_MAIL_BYTES = 10 * 1024 * 1024
MAIL_BESIDE_ATTACHMENT_BYTES = 2 * 1024 * 1024  # its text, headers, other parts


def mail_limit(max_attachment_bytes: int) -> int:
    """The largest mail read when one attachment may be `max_attachment_bytes`."""
    encoded = -(-max_attachment_bytes * 4 // 3)  # base64, rounded up
    return max(MAX_MAIL_BYTES, encoded + MAIL_BESIDE_ATTACHMENT_BYTES)


# The header block we fetch and read at most: mail servers write a few to some tens of KiB.
MAX_HEADER_BLOCK_BYTES = 256 * 1024
# One header we read (From, Subject, Message-ID, Content-Type...): a legitimate one is under
# 1 KiB (RFC 5322 lines stop at 998 characters); parsing 8 KiB costs policy.default at worst
# ~30 ms and ~6 MB, 100 KiB cost it 400 MB.
MAX_HEADER_BYTES = 8 * 1024
MAX_MIME_PARTS = 200  # a newsletter with its inline images has a few dozen
MAX_TEXT_CHARS = 100_000
# HTML converted at most (~0.6 s a MiB): far more markup than MAX_TEXT_CHARS of text needs.
MAX_HTML_CHARS = 2 * 1024 * 1024
MAX_ATTACHMENTS_LISTED = 20  # in the text; meta lists every name (at most MAX_MIME_PARTS)
MAX_ATTACHMENT_NAME_CHARS = 100
MAX_REFERENCES = 50  # Message-IDs of a thread kept for our reply's References
MAX_ATTACHED_MAILS = 5  # mails attached to a mail that are read (a forward carries one)
MAX_AUTHOR_CHARS = 200  # a forwarded part's author, as the handoff and approvals name them
PREVIEW_CHARS = 200  # of a header we will not parse, for the failed row and the log
# A picture the mail's HTML shows among its words (by Content-ID) this small or smaller is its
# decoration: a signature's logo and social icons are 1-15 KB (Outlook sends each as a file
# under multipart/related, five of them filling max_attachments_per_message before the PDF
# the mail was about); a photo or a screenshot pasted among the words is larger.
DECORATION_MAX_BYTES = 16 * 1024
