"""Every SQL statement of the switchboard's stores, by name: one place to read (and review) what
touches a table of the switchboard's database, like procrastinate's `sql/queries.sql`.

Its stores run these and nothing else: butlers.switchboard.routing_store (butler_registry,
routing_log), .inbox, .outbox, .approvals, .pairing, .operator, and the dashboard's pages
(butlers.dashboard.store), which reuse the registry's statements rather than copying them.

Written as butlers.queries (the core tables') is, and for the same reasons: a statement is an
upper-case `str` with a comment saying what it does, a `Fragment` a piece composed into
statements at import, a `Filtered` statement one whose WHERE holds only the filters given.
tests/test_queries.py PREPAREs every one against a migrated switchboard database.
"""

from __future__ import annotations

from butlers.queries import PERSON_OF_CONVERSATION, Filtered, Fragment

# -- traces: shared by the operator's tools and the dashboard -------------------------------

# A row's trace id: its stored trace context's (W3C traceparent). Approvals are indexed on
# this very expression (switchboard_0013): written otherwise, the index is not used.
TRACE_OF_CONTEXT = Fragment(
    "substring(trace_context->>'traceparent' FROM '^[0-9a-f]{2}-([0-9a-f]{32})-')"
)
# Over a CTE `page` of inbox rows with `traced`: each row with its trace_id, which for a row
# without a stored context (an envelope kept by `record_failed`, a row from before tracing)
# is its first route's. Newest first.
WITH_ROUTED_TRACE = Fragment("""
    SELECT page.*, coalesce(page.traced, routed.trace_id) AS trace_id
    FROM page LEFT JOIN LATERAL (
        SELECT r.trace_id FROM routing_log r
        WHERE page.traced IS NULL AND r.inbox_id = page.id AND r.trace_id IS NOT NULL
        ORDER BY r.created_at LIMIT 1
    ) AS routed ON true
    ORDER BY page.id DESC
""")

# -- butler_registry and routing_log (RoutingStore; the dashboard's registry) ---------------

# The spec's six columns of a registry row.
_REGISTRY_COLUMNS = Fragment(
    "name, endpoint_url, description, modules, last_seen_at, registered_at"
)
# Beyond the spec's six: whether the last discover missed the butler (route refuses it until
# one sees it again) and whether it is a switchboard (route refuses it whatever its name).
_ROUTABILITY_COLUMNS = Fragment("missing_since IS NOT NULL AS stale, is_switchboard")

# Every butler (list_butlers, the classifier's list, discover, the dashboard's fleet).
REGISTRY = f"SELECT {_REGISTRY_COLUMNS}, {_ROUTABILITY_COLUMNS} FROM butler_registry ORDER BY name"
# One butler by name, the same columns (the dashboard's butler page).
REGISTRY_BUTLER = (
    f"SELECT {_REGISTRY_COLUMNS}, {_ROUTABILITY_COLUMNS} FROM butler_registry WHERE name = $1"
)
# What route needs of one butler to decide whether it may call it, and where: the route hot
# path's first statement (only the columns it reads).
REGISTRY_TARGET = (
    f"SELECT name, endpoint_url, modules, {_ROUTABILITY_COLUMNS} "
    "FROM butler_registry WHERE name = $1"
)
# discover: when this server started (the same text as butlers.queries.PING's).
SERVER_STARTED = "SELECT extract(epoch FROM pg_postmaster_start_time())::text"
# discover: insert a butler found in the config directory, or refresh it; seen now.
REGISTRY_UPSERT = """
    INSERT INTO butler_registry
        (name, endpoint_url, description, modules, is_switchboard, last_seen_at)
    VALUES ($1, $2, $3, $4, $5, now())
    ON CONFLICT (name) DO UPDATE SET
        endpoint_url = EXCLUDED.endpoint_url,
        description = EXCLUDED.description,
        modules = EXCLUDED.modules,
        is_switchboard = EXCLUDED.is_switchboard,
        missing_since = NULL,
        last_seen_at = now()
"""
# discover: every butler not found ($1: those found) is stale from its first miss on.
REGISTRY_MARK_MISSING = """
    UPDATE butler_registry SET missing_since = coalesce(missing_since, now())
    WHERE NOT (name = ANY($1::text[]))
"""
# One routing_log row by id (routing_log_get).
ROUTING_LOG_ENTRY = """
    SELECT id::text AS id, created_at, source_channel, source_id, routed_to,
           tool_name, prompt_summary, success, error, duration_ms, trace_id
    FROM routing_log WHERE id = $1
"""
# Log one route and, when $12 says so (it succeeded, and no route before it in the same write
# stamped the same target), stamp its target as seen. RoutingStore writes the
# routes that waited for one write together with asyncpg's executemany: one round trip and
# one transaction for all of them, each row's created_at the moment it was written, in the
# order given. (One row a statement, not one statement over arrays: at one or two rows a
# write, what routes at any load here, `unnest` over eleven arrays cost the butlers' process
# ~20 us more CPU and the caller ~40 us more wait per row; bench/route_write.py.) The stamp
# is best effort: a registry row locked elsewhere (a discover under way, an operator's open
# transaction, another switchboard's write) keeps its older stamp, and no write ever waits
# for a lock (so none deadlocks). Committed asynchronously for this transaction only
# (`set_config(..., true)` ends with it): the WAL flush was a sixth of a routed call's
# latency; a crash of the server may lose the last fraction of a second of log rows, never
# half a row.
ROUTING_LOG_RECORD = """
    WITH async_commit AS (
        SELECT set_config('synchronous_commit', 'off', true)
    ), seen AS (
        UPDATE butler_registry SET last_seen_at = now()
        WHERE name = (SELECT name FROM butler_registry WHERE $12::boolean AND name = $4::text
                      FOR UPDATE SKIP LOCKED)
    )
    INSERT INTO routing_log (id, source_channel, source_id, routed_to, tool_name,
                             prompt_summary, trace_id, success, error, duration_ms,
                             inbox_id, created_at)
    SELECT $1::uuid, $2::text, $3::text, $4::text, $5::text, $6::text, $7::text, $8::boolean,
           $9::text, $10::integer, $11::bigint, clock_timestamp()
    FROM async_commit
"""
# The butlers a message was handed to (trigger) since $2 (its requeue by the operator, or
# NULL), in the order it first was, and whether one of those routes answered: a message
# claimed again after its process stopped or lost it is not handed to those that answered
# again (RoutingStore.handed_before).
ROUTING_LOG_HANDED = """
    SELECT routed_to, bool_or(success) AS answered FROM routing_log
    WHERE inbox_id = $1 AND tool_name = 'trigger'
      AND ($2::timestamptz IS NULL OR created_at > $2)
    GROUP BY routed_to ORDER BY min(created_at)
"""
# Retention: routing_log rows older than $1 days.
ROUTING_LOG_PRUNE = "DELETE FROM routing_log WHERE created_at < now() - make_interval(days => $1)"

# -- inbox (InboxStore) --------------------------------------------------------------------

# A message in, once: a redelivery (the same channel id) inserts nothing and returns no id.
# $10: seconds before it may be claimed (an album's first message waits for the rest), or NULL.
INBOX_ACCEPT = """
    INSERT INTO inbox (channel, external_id, source_id, sender_name, subject, text, meta,
                       trace_context, conversation, not_before)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, clock_timestamp() + make_interval(secs => $10))
    ON CONFLICT (channel, external_id) DO NOTHING
    RETURNING id
"""
# -- albums: the photos and files of one Telegram album come as a message each; the inbox
# joins them into the album's first message while that one still waits in the queue.
# The parts of one album ($1 channel, $2 conversation, $3 album) are taken one at a time, so
# that two arriving at once (webhook requests) do not both become a first message.
INBOX_ALBUM_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended($1 || ' ' || $2 || ' ' || $3, 0))"
# The album's first message, if it is still queued (held until the transaction ends) and its
# voice notes were not heard yet (an audio part joining a message already transcribed would
# never be), how many files it lists and the position after its last file's (audio taken away
# once heard leaves gaps); the newest, when the album was more files than one message takes.
INBOX_ALBUM_FIRST = """
    SELECT id, jsonb_array_length(coalesce(meta -> 'attachments', '[]')) AS files,
           (SELECT coalesce(max(position) + 1, 0) FROM inbox_attachments a
            WHERE a.inbox_id = inbox.id) AS next_position
    FROM inbox
    WHERE channel = $1 AND conversation = $2 AND meta ->> 'album' = $3
      AND status = 'queued' AND NOT meta ? 'transcribed'
    ORDER BY id DESC LIMIT 1
    FOR UPDATE
"""
# A part joined to the first message: kept as a row of its own, finished at once (its channel
# id is still taken: a redelivery is a duplicate), classified "album", its meta naming the
# first ($10).
INBOX_ALBUM_PART = """
    INSERT INTO inbox (channel, external_id, source_id, sender_name, subject, text, meta,
                       trace_context, conversation, status, classified_via, finished_at)
    VALUES ($1, $2, $3, $4, $5, $6, $7 || jsonb_build_object('album_of', $10::bigint), $8, $9,
            'done', 'album', now())
    ON CONFLICT (channel, external_id) DO NOTHING
    RETURNING id
"""
# The first message ($1) takes a part: its text ($2, a caption) on a line after its own, its
# files' listing ($3) after its own, a voice note's flag ($4), and it is not claimed for $5
# seconds from now (the latest part says how long the rest of the album may take; from the
# clock, not the transaction's start, which may have waited for the album's lock). A message
# put back for a while (its voice service failing: "deferred_since") is not brought forward.
# A part that will not come (its file refused once downloaded) joins nothing ($2 '', $3 no
# files, $4 false): it only sets the wait, as a part that came would.
INBOX_ALBUM_JOIN = """
    UPDATE inbox SET
        text = CASE WHEN $2 = '' THEN text WHEN text = '' THEN $2 ELSE text || E'\n' || $2 END,
        meta = meta || jsonb_build_object(
            'attachments', coalesce(meta -> 'attachments', '[]') || $3::jsonb)
            || CASE WHEN $4 THEN '{"voice": true}'::jsonb ELSE '{}'::jsonb END,
        not_before = CASE WHEN meta ? 'deferred_since'
            THEN greatest(not_before, clock_timestamp() + make_interval(secs => $5))
            ELSE clock_timestamp() + make_interval(secs => $5) END
    WHERE id = $1
"""
# The album's first message ($1) is full (max_files): no part will join it, so it need not
# wait for one (unless it was put back for a while).
INBOX_ALBUM_FULL = """
    UPDATE inbox SET not_before = least(not_before, clock_timestamp())
    WHERE id = $1 AND NOT meta ? 'deferred_since'
"""
# A message's files, in its transaction; their digest and size are PostgreSQL's to work out,
# not the event loop's.
INBOX_ATTACHMENT_ADD = """
    INSERT INTO inbox_attachments (inbox_id, position, name, mime_type, size, sha256, data)
    VALUES ($1, $2, $3, $4, octet_length($5::bytea), encode(sha256($5::bytea), 'hex'),
            $5::bytea)
"""
# A message's files, in the sender's order.
INBOX_ATTACHMENTS = """
    SELECT name, mime_type, data FROM inbox_attachments
    WHERE inbox_id = $1 ORDER BY position
"""
# A voice note heard, while $3 holds the claim: $2 becomes the text (meta "voice" and
# "transcribed"), and unless $4 (keep the audio) the audio files go, their rows and their
# lines in meta "attachments". One statement: the text and the audio go together.
INBOX_TRANSCRIBED = """
    WITH message AS (
        UPDATE inbox SET text = $2,
            meta = CASE
                WHEN $4 OR jsonb_typeof(meta -> 'attachments') IS DISTINCT FROM 'array'
                THEN meta || jsonb_build_object(
                    'voice', true, 'transcribed', true, 'transcript_at', $5::int)
                ELSE meta || jsonb_build_object(
                    'voice', true, 'transcribed', true, 'transcript_at', $5::int,
                    'attachments', coalesce(
                    (SELECT jsonb_agg(a ORDER BY n)
                     FROM jsonb_array_elements(meta -> 'attachments')
                          WITH ORDINALITY AS listed (a, n)
                     WHERE a ->> 'kind' IS DISTINCT FROM 'audio'),
                    '[]'::jsonb))
            END
        WHERE id = $1 AND claimed_by = $3 AND status = 'processing'
        RETURNING id
    ), audio AS (
        DELETE FROM inbox_attachments
        WHERE NOT $4 AND inbox_id = (SELECT id FROM message)
          AND mime_type LIKE 'audio/%'
    )
    SELECT count(*) = 1 FROM message
"""
# Put a message $2 holds back in the queue for $3 seconds ($4: why): the attempt does not
# count; meta keeps the first deferral's time ("deferred_since") and counts the deferrals in
# a row that timed out ($5) in "timeouts".
INBOX_DEFER = """
    UPDATE inbox SET status = 'queued', claimed_by = NULL, lease_until = NULL,
           attempts = greatest(attempts - 1, 0),
           not_before = now() + make_interval(secs => $3), error = $4,
           meta = jsonb_set(
               CASE WHEN meta ? 'deferred_since' THEN meta
                    ELSE meta || jsonb_build_object('deferred_since', now()) END,
               '{timeouts}',
               to_jsonb(CASE WHEN $5 THEN coalesce((meta ->> 'timeouts')::int, 0) + 1
                             ELSE 0 END))
    WHERE id = $1 AND claimed_by = $2 AND status = 'processing'
"""
# A message that cannot be stored, kept as a `failed` envelope (its content is what failed).
INBOX_RECORD_FAILED = """
    INSERT INTO inbox (channel, external_id, source_id, subject, text, status, error,
                       finished_at)
    VALUES ($1, $2, $3, $4, '', 'failed', $5, now())
    ON CONFLICT (channel, external_id) DO NOTHING
    RETURNING id
"""
# At start-up: what this process ($1) left `processing` goes back to the queue, and rows
# claimed by nobody in particular (from before leases).
# What the claimants $1 (processes gone) left under way, or nobody in particular (from before
# leases): back in its place.
INBOX_REQUEUE_INTERRUPTED = """
    UPDATE inbox SET status = 'queued', claimed_by = NULL, lease_until = NULL
    WHERE status = 'processing' AND (claimed_by IS NULL OR claimed_by = ANY($1::text[]))
"""
# Who has messages under way among the processes named $1 (`host:port`, claiming as
# `host:port/<random>`; older releases as the name itself).
INBOX_CLAIMANTS_UNDER_WAY = """
    SELECT DISTINCT claimed_by FROM inbox
    WHERE status = 'processing' AND (claimed_by = $1 OR starts_with(claimed_by, $1 || '/'))
"""
# The oldest message that may start now, claimed for $1 for $2 seconds, with its sender's
# last hour. May start: queued and not deferred past now, or its lease ran out; and nothing
# older of its conversation pending, nothing of it in flight. FOR UPDATE SKIP LOCKED: two
# processes claiming at once take different messages. (`i.id + 0`: not an index condition.
# On a year's inbox the planner ANDed the primary key's index into the sender's count, which
# read every older message's id: 60,000 ids, 4.4 ms a claim: a year of data's walkthrough.)
INBOX_CLAIM_NEXT = """
    WITH candidate AS (
        SELECT q.id FROM inbox q
        WHERE ((q.status = 'queued' AND (q.not_before IS NULL OR q.not_before <= now()))
               OR (q.status = 'processing' AND q.lease_until < now()))
          AND NOT q.id = ANY($3::bigint[])
          AND NOT EXISTS (
              SELECT 1 FROM inbox o
              WHERE o.conversation = q.conversation AND o.id <> q.id
                AND o.status IN ('queued', 'processing')
                AND (o.id < q.id OR o.lease_until >= now())
          )
        ORDER BY q.id LIMIT 1
        FOR UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE inbox SET status = 'processing', attempts = attempts + 1,
                         claimed_by = $1,
                         lease_until = now() + make_interval(secs => $2)
        WHERE id = (SELECT id FROM candidate)
        RETURNING *
    )
    SELECT claimed.*, sender.earlier AS earlier_from_sender, sender.told AS sender_told
    FROM claimed CROSS JOIN LATERAL (
        SELECT count(*) AS earlier,
               coalesce(bool_or(i.status = 'skipped'), false) AS told
        FROM inbox i
        WHERE i.channel = claimed.channel AND i.source_id = claimed.source_id
          AND i.received_at > claimed.received_at - interval '1 hour'
          AND i.id + 0 < claimed.id AND i.classified_via IS DISTINCT FROM 'album'
    ) AS sender
"""
# Whether any message of channel $1 is stored (through inbox_sender_received, its first key).
INBOX_HOLDS_CHANNEL = "SELECT EXISTS (SELECT 1 FROM inbox WHERE channel = $1)"
# How many messages the sender $2 of channel $1 sent in the last hour, but those of album $3
# (album parts not
# counted): INBOX_CLAIM_NEXT's count, for a message about to be accepted.
INBOX_SENDER_LAST_HOUR = """
    SELECT count(*) FROM inbox
    WHERE channel = $1 AND source_id = $2 AND received_at > now() - interval '1 hour'
      AND classified_via IS DISTINCT FROM 'album'
      AND ($3::text IS NULL OR meta ->> 'album' IS DISTINCT FROM $3)
"""
# Extend $1's leases on the messages $2 by $3 seconds; the ids it still holds, counting those
# it finished meanwhile (its worker is between that commit and letting go of them).
INBOX_RENEW = """
    WITH renewed AS (
        UPDATE inbox SET lease_until = now() + make_interval(secs => $3)
        WHERE id = ANY($2::bigint[]) AND claimed_by = $1 AND status = 'processing'
        RETURNING id
    )
    SELECT id FROM renewed
    UNION
    SELECT id FROM inbox
    WHERE id = ANY($2::bigint[]) AND claimed_by = $1
      AND status IN ('done', 'failed', 'skipped')
"""
# A process stopping on purpose hands back its messages: the attempt does not count.
INBOX_RELEASE = """
    UPDATE inbox SET status = 'queued', claimed_by = NULL, lease_until = NULL,
           attempts = greatest(attempts - 1, 0)
    WHERE id = ANY($2::bigint[]) AND claimed_by = $1 AND status = 'processing'
"""
# A message's outcome, if $7 still holds its claim.
INBOX_FINISH = """
    UPDATE inbox SET status = $2, routed_to = coalesce($3, routed_to), reply = $4,
           error = $5, classified_via = coalesce($6, classified_via),
           finished_at = now(), lease_until = NULL
    WHERE id = $1 AND claimed_by = $7 AND status = 'processing'
"""
# The last $3 handled messages of conversation $1 before message $2, newest first.
INBOX_HISTORY = """
    SELECT sender_name, source_id, subject, text, routed_to, reply,
           meta->>'forwarded_from' AS forwarded_from FROM inbox
    WHERE conversation = $1 AND id < $2 AND status = 'done'
      AND classified_via IS DISTINCT FROM 'album'
    ORDER BY id DESC LIMIT $3
"""
# The newest message of a conversation (whom a notification to it goes to).
INBOX_LAST_OF_CONVERSATION = """
    SELECT *, 0 AS earlier_from_sender, false AS sender_told FROM inbox
    WHERE conversation = $1 ORDER BY id DESC LIMIT 1
"""
# Retention: finished messages older than $1 days (their files go by the cascade).
INBOX_PRUNE = """
    DELETE FROM inbox WHERE finished_at < now() - make_interval(days => $1)
    AND status IN ('done', 'failed', 'skipped')
"""
# One row, whole.
INBOX_GET = "SELECT * FROM inbox WHERE id = $1"

# -- outbox (OutboxStore) ------------------------------------------------------------------

# In a row's meta: its last attempt was refused for its recipient only (RecipientDeferred),
# so it holds back only that recipient's later rows.
HELD_KEY = Fragment("held_for_recipient")
SENDER_KEY = Fragment("sender")  # the replica sending a `sending` row (OUTBOX_CLAIM)

# Queue one message (its transaction is the caller's: the inbox row it answers).
OUTBOX_ADD = """
    INSERT INTO outbox (kind, inbox_id, butler, channel, recipient, conversation, text, meta,
                        trace_context)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
"""
# The same, for a message with files: their rows need its id.
OUTBOX_ADD_RETURNING_ID = OUTBOX_ADD + " RETURNING id"
# A queued message's files, in order.
OUTBOX_ATTACHMENT_ADD = """
    INSERT INTO outbox_attachments (outbox_id, position, name, mime_type, data)
    VALUES ($1, $2, $3, $4, $5)
"""
# Each recipient's first unsent row of channel $1: the others wait for it (one pass over the
# unsent rows, whatever their number).
_RECIPIENT_HEADS = Fragment("""
    SELECT min(h.id) FROM outbox h
    WHERE h.channel = $1 AND h.status IN ('pending', 'sending') GROUP BY h.recipient
""")
# The rows `o` that may go next (due or not): their recipient's first, and not after the
# channel's first such row that waits for the channel (one not held for its recipient).
# Both found once per statement: asked row by row ("is any older row in the way"), finding the
# next due time took 200-500 ms with 10,000 rows queued.
_MAY_GO = Fragment(f"""
    o.id IN ({_RECIPIENT_HEADS})
    AND o.id <= (
        SELECT coalesce(min(f.id), 9223372036854775807) FROM outbox f
        WHERE f.id IN ({_RECIPIENT_HEADS})
          AND NOT coalesce((f.meta ->> '{HELD_KEY}')::boolean, false)
    )
""")
# Channel $1's next row, now `sending` by sender $2 until $3 seconds from now, if it may go
# and is due. A row being sent is due only when its lease is up, whoever sent it (a leader
# that lost its lock sends on until it notices, up to seconds later: taken at once, its row
# went out twice; a send this process cut short may have reached the channel all the same).
OUTBOX_CLAIM = f"""
    WITH head AS (
        SELECT o.id FROM outbox o
        WHERE {_MAY_GO} AND o.next_attempt_at <= now()
        ORDER BY o.id LIMIT 1 FOR UPDATE SKIP LOCKED
    )
    UPDATE outbox SET status = 'sending', attempts = outbox.attempts + 1,
           next_attempt_at = now() + make_interval(secs => $3),
           meta = coalesce(outbox.meta, '{{}}') || jsonb_build_object('{SENDER_KEY}', $2::text)
    FROM head WHERE outbox.id = head.id
    RETURNING outbox.*
"""
# A claimed row's files, in order.
OUTBOX_ATTACHMENTS = """
    SELECT name, mime_type, data FROM outbox_attachments
    WHERE outbox_id = $1 ORDER BY position
"""
# Seconds until channel $1's next row that may go is due; NULL when there is none.
OUTBOX_HEAD_DUE_IN_S = f"""
    SELECT greatest(0, extract(epoch FROM min(o.next_attempt_at) - now()))::float8
    FROM outbox o WHERE {_MAY_GO}
    HAVING count(*) > 0
"""
# The channel took it: its own ids ($2) are kept for thread affinity.
# Taken by its channel: its files are needed no more (they stayed for retention_days).
OUTBOX_SENT = """
    WITH sent AS (
        UPDATE outbox SET status = 'sent', sent_at = now(), sent_ids = $2, error = NULL
        WHERE id = $1 RETURNING id
    )
    DELETE FROM outbox_attachments WHERE outbox_id IN (SELECT id FROM sent)
"""
# Only while sender $2 still has the row (when given): one whose lease ran out (its process
# paused past it) may have been sent by another since, and must not be put back or failed.
_STILL_SENDING = Fragment(f"""
    ($2::text IS NULL OR (status = 'sending' AND meta ->> '{SENDER_KEY}' = $2))
""")
# Not taken: again in $4 seconds; $5: held for its recipient only (HELD_KEY).
OUTBOX_LATER = f"""
    UPDATE outbox SET status = 'pending', error = $3,
           next_attempt_at = now() + make_interval(secs => $4),
           meta = CASE WHEN $5 THEN coalesce(meta, '{{}}') || '{{"{HELD_KEY}": true}}'
                       ELSE meta - '{HELD_KEY}' END
    WHERE id = $1 AND {_STILL_SENDING}
"""
# Refused for good, or out of retry time.
OUTBOX_FAILED = (
    f"UPDATE outbox SET status = 'failed', error = $3 WHERE id = $1 AND {_STILL_SENDING}"
)
# Sender $2 is still sending row $1: its lease runs $3 seconds from now.
OUTBOX_RENEW = f"""
    UPDATE outbox SET next_attempt_at = now() + make_interval(secs => $3)
    WHERE id = $1 AND status = 'sending' AND meta ->> '{SENDER_KEY}' = $2
"""
# Thread affinity: the butler whose message (one of the channel's ids $3) to recipient $2 on
# channel $1 this person answers, if sent in the last $4 days.
OUTBOX_BUTLER_ANSWERING = """
    SELECT butler FROM outbox
    WHERE channel = $1 AND recipient = $2 AND sent_ids && $3::text[]
      AND butler IS NOT NULL AND status = 'sent'
      AND created_at > now() - make_interval(days => $4)
    ORDER BY id DESC LIMIT 1
"""
# A butler's notifications of the last hour (a notification split in chunks counts once).
OUTBOX_NOTIFICATIONS_LAST_HOUR = """
    SELECT count(DISTINCT (conversation, created_at)) FROM outbox
    WHERE kind = 'notification' AND butler = $1
      AND created_at > now() - interval '1 hour'
"""
# Retention: sent and failed rows older than $1 days (their files go by the cascade).
OUTBOX_PRUNE = """
    DELETE FROM outbox WHERE created_at < now() - make_interval(days => $1)
    AND status IN ('sent', 'failed')
"""

# -- approvals (ApprovalStore, ApprovalDesk) -----------------------------------------------

# What the approval statements return of a row.
_APPROVAL_ROW = Fragment("""
    id, butler, tool, arguments, status, requested_at, expires_at, decided_at, decided_by,
    claimed_at, finished_at, result, conversation, session_id, trace_context, asked,
    forwarded_from""")

# The buttons' signing key, made once per database: the first writer's wins.
APPROVAL_KEY_ADD = (
    "INSERT INTO approval_keys (id, secret) VALUES (1, $1) ON CONFLICT (id) DO NOTHING"
)
APPROVAL_KEY = "SELECT secret FROM approval_keys WHERE id = 1"
# A call waiting for the owner, expiring in $6 seconds; none while person $10 (of its
# conversation: `telegram:<chat>` of any topic, `email:<address>` of any thread, which the
# sender starts; '' for the owner's sessions) has $9 waiting already. Taken under
# APPROVAL_PERSON_LOCK, so that calls at once do not all pass the count.
APPROVAL_CREATE = f"""
    INSERT INTO approvals (butler, tool, arguments, conversation, session_id,
                           expires_at, trace_context, forwarded_from)
    SELECT $1, $2, $3, $4, $5, now() + make_interval(secs => $6), $7, $8
    WHERE (SELECT count(*) FROM approvals
           WHERE status = 'pending'
             AND {PERSON_OF_CONVERSATION} = $10) < $9
    RETURNING {_APPROVAL_ROW}
"""
APPROVAL_PERSON_LOCK = "SELECT pg_advisory_xact_lock(hashtext('approvals:' || $1))"
APPROVAL_GET = f"SELECT {_APPROVAL_ROW} FROM approvals WHERE id = $1"
# The approvals whose question went out as one of the mails $1 (a reply's thread).
APPROVAL_ASKED_BY_MAIL = f"""
    SELECT {_APPROVAL_ROW} FROM approvals WHERE asked->>'email' = ANY($1::text[])
    ORDER BY id DESC LIMIT 100
"""
# The newest $2, of status $1 (NULL: any), with ids below $3 (NULL: any).
APPROVAL_NEWEST = f"""
    SELECT {_APPROVAL_ROW} FROM approvals
    WHERE ($1::text IS NULL OR status = $1) AND ($3::bigint IS NULL OR id < $3)
    ORDER BY id DESC LIMIT $2
"""
# A decision: one conditional UPDATE, so of any number of concurrent ones exactly one wins.
APPROVAL_DECIDE = f"""
    UPDATE approvals SET status = $2, decided_at = now(), decided_by = $3
    WHERE id = $1 AND status = 'pending' AND expires_at > now()
    RETURNING {_APPROVAL_ROW}
"""
# Butler $2 takes the approved call, once (`claimed_at` is set only here).
APPROVAL_CLAIM = """
    UPDATE approvals SET claimed_at = now()
    WHERE id = $1 AND butler = $2 AND status = 'approved' AND claimed_at IS NULL
    RETURNING id, tool, arguments, conversation, forwarded_from
"""
# How an approved call ended ($2: done | failed).
APPROVAL_FINISH = f"""
    UPDATE approvals SET status = $2, result = $3, finished_at = now()
    WHERE id = $1 AND status = 'approved' RETURNING {_APPROVAL_ROW}
"""
# `failed`, if no butler has taken it: never a running one.
APPROVAL_FAIL_UNTAKEN = f"""
    UPDATE approvals SET status = 'failed', result = $2, finished_at = now()
    WHERE id = $1 AND status = 'approved' AND claimed_at IS NULL RETURNING {_APPROVAL_ROW}
"""
# The leader's sweep: overdue pending rows expire.
APPROVAL_EXPIRE_DUE = f"""
    UPDATE approvals SET status = 'expired', decided_at = now()
    WHERE status = 'pending' AND expires_at <= now() RETURNING {_APPROVAL_ROW}
"""
# Approved calls no butler took, decided at least $1 seconds ago.
APPROVAL_UNCLAIMED = """
    SELECT id FROM approvals
    WHERE status = 'approved' AND claimed_at IS NULL
      AND decided_at < now() - make_interval(secs => $1)
    ORDER BY id
"""
# The approval whose question to $2 on channel $1 was the message $3 (a chat's reply names the
# one message it answers; each chunk of a long question says which approval it asks about).
APPROVAL_ASKED_IN_MESSAGE = """
    SELECT (meta->>'asks_approval')::bigint FROM outbox
    WHERE kind = 'approval' AND channel = $1 AND recipient = $2 AND status = 'sent'
      AND sent_ids @> ARRAY[$3::text] AND meta ? 'asks_approval'
    ORDER BY id DESC LIMIT 1
"""
# The owner's Telegram question(s) with buttons for approval $1, as sent.
APPROVAL_TELEGRAM_QUESTIONS = """
    SELECT recipient, text, sent_ids FROM outbox
    WHERE kind = 'approval' AND channel = 'telegram' AND status = 'sent'
      AND meta->>'approval_id' = $1::bigint::text
"""
# Retention: decided approvals whose outcome is older than $1 days (never a pending or
# approved one: those still have something to do).
APPROVAL_PRUNE = """
    DELETE FROM approvals
    WHERE status IN ('denied', 'expired', 'done', 'failed')
      AND coalesce(finished_at, decided_at, requested_at)
          < now() - make_interval(days => $1)
"""
# Calls taken over $1 seconds ago and never reported: `failed`, never run twice.
APPROVAL_CLAIMS_LOST = f"""
    UPDATE approvals SET status = 'failed', finished_at = now(),
           result = 'its butler took it but never said how it ended'
    WHERE status = 'approved' AND claimed_at < now() - make_interval(secs => $1)
    RETURNING {_APPROVAL_ROW}
"""
# Where the owner was asked (channel: the request mail's Message-ID), in the outbox's
# transaction: an answer by mail counts only in that thread.
APPROVAL_ASKED = "UPDATE approvals SET asked = $2 WHERE id = $1"
# The name to show for person $1:$2 (channel, sender) in the owner's question: the one shown
# when the owner paired them, else the one on their newest message in conversation $3 ($4:
# whether that conversation is with them alone, not a group's). Both are the person's choice.
APPROVAL_NAME_OF = """
    SELECT name FROM (
        SELECT name, 0 AS rank FROM paired_senders
        WHERE channel = $1 AND sender = $2 AND name <> ''
        UNION ALL
        (SELECT sender_name, 1 FROM inbox
         WHERE $4 AND conversation = $3 AND sender_name <> '' ORDER BY id DESC LIMIT 1)
    ) AS names ORDER BY rank LIMIT 1
"""

# -- pairing (PairingStore, PairingDesk) ---------------------------------------------------

# What the pairing statements return of a request.
_PAIRING_ROW = Fragment("""
    id, channel, sender, name, code, status, created_at, expires_at, decided_at, decided_by""")

# Serialises, per channel $1, "is there room for one more pending code" with taking it.
PAIRING_CHANNEL_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('butlers.pairing:' || $1, 0))"
# Serialises every decision by code with counting the wrong ones.
PAIRING_ATTEMPTS_LOCK = (
    "SELECT pg_advisory_xact_lock(hashtextextended('butlers.pairing.attempts', 0))"
)
# Whether sender $2 of channel $1 is paired: one primary-key lookup per message.
PAIRING_IS_PAIRED = "SELECT true FROM paired_senders WHERE channel = $1 AND sender = $2"
# Pending codes past their time expire (of channel $1; NULL: every channel).
PAIRING_EXPIRE = """
    UPDATE pairing_requests SET status = 'expired'
    WHERE status = 'pending' AND expires_at <= now()
      AND ($1::text IS NULL OR channel = $1)
"""
# Requests that no longer decide anything: answered over $2 seconds ago and not pending,
# except a denial within $3 days (it keeps its sender quiet).
PAIRING_PRUNE = """
    DELETE FROM pairing_requests
    WHERE channel = $1 AND status <> 'pending'
      AND created_at < now() - make_interval(secs => $2)
      AND NOT (status = 'denied'
               AND decided_at > now() - make_interval(days => $3))
"""
# Whether sender $2 holds a code still valid, got one within $3 seconds, or was denied within
# $4 days.
PAIRING_ANSWERED_RECENTLY = """
    SELECT EXISTS (
        SELECT 1 FROM pairing_requests
        WHERE channel = $1 AND sender = $2
          AND (created_at > now() - make_interval(secs => $3)
               OR status = 'pending'
               OR (status = 'denied'
                   AND decided_at > now() - make_interval(days => $4))))
"""
PAIRING_PENDING_COUNT = (
    "SELECT count(*) FROM pairing_requests WHERE channel = $1 AND status = 'pending'"
)
# A new pending code (its digest $5), valid for $6 minutes.
PAIRING_CREATE = f"""
    INSERT INTO pairing_requests (channel, sender, name, code, code_digest, expires_at)
    VALUES ($1, $2, $3, $4, $5, now() + make_interval(mins => $6))
    RETURNING {_PAIRING_ROW}
"""
# A decision by code or by id: one conditional UPDATE, so a code is taken once.
PAIRING_DECIDE_BY_DIGEST = f"""
    UPDATE pairing_requests SET status = $2, decided_at = now(), decided_by = $3
    WHERE code_digest = $1 AND status = 'pending' AND expires_at > now()
    RETURNING {_PAIRING_ROW}
"""
PAIRING_DECIDE_BY_ID = f"""
    UPDATE pairing_requests SET status = $2, decided_at = now(), decided_by = $3
    WHERE id = $1 AND status = 'pending' AND expires_at > now()
    RETURNING {_PAIRING_ROW}
"""
PAIRING_BY_DIGEST = f"SELECT {_PAIRING_ROW} FROM pairing_requests WHERE code_digest = $1"
PAIRING_GET = f"SELECT {_PAIRING_ROW} FROM pairing_requests WHERE id = $1"
# An approved sender, paired (again: the newest approval's name and approver count).
PAIRING_PAIR = """
    INSERT INTO paired_senders (channel, sender, name, approved_by)
    VALUES ($1, $2, $3, $4)
    ON CONFLICT (channel, sender) DO UPDATE
    SET name = excluded.name, approved_at = now(), approved_by = excluded.approved_by
"""
PAIRING_UNPAIR = """
    DELETE FROM paired_senders WHERE channel = $1 AND sender = $2
    RETURNING channel, sender, name, approved_at, approved_by
"""
# Wrong codes stop counting after an hour.
PAIRING_FORGET_WRONG_CODES = "DELETE FROM pairing_failures WHERE at <= now() - interval '1 hour'"
# The wrong codes of the last hour, and when the oldest of them stops counting.
PAIRING_WRONG_CODES = (
    "SELECT count(*) AS n, min(at) + interval '1 hour' AS until FROM pairing_failures"
)
PAIRING_WRONG_CODE = "INSERT INTO pairing_failures (by) VALUES ($1)"
PAIRING_PENDING = (
    f"SELECT {_PAIRING_ROW} FROM pairing_requests WHERE status = 'pending' ORDER BY id"
)
# The newest $1 paired senders.
PAIRING_PAIRED = """
    SELECT channel, sender, name, approved_at, approved_by FROM paired_senders
    ORDER BY approved_at DESC LIMIT $1
"""
# The owner's Telegram question(s) with buttons for pairing $1, as sent.
# The pairing whose owner's question mail (to $2) is one of the mails $1 (a reply's thread).
PAIRING_ASKED_IN = """
    SELECT (meta->>'pairing_id')::bigint FROM outbox
    WHERE kind = 'pairing' AND channel = $3 AND lower(recipient) = lower($2)
      AND status = 'sent' AND sent_ids && $1::text[] AND meta ? 'pairing_id'
    ORDER BY id DESC LIMIT 1
"""
PAIRING_OWNER_QUESTIONS = """
    SELECT recipient, text, sent_ids FROM outbox
    WHERE kind = 'pairing' AND channel = 'telegram' AND status = 'sent'
      AND meta ? 'inline_keyboard'
      AND meta->>'pairing_id' = $1::bigint::text
"""

# -- the operator's tools (OperatorStore: inbox_list, routing_log_list, outbox_list, retry) -----

# The names of an inbox row's files (its meta "attachments"; NULL: none): a photo sent
# without words is a message all the same, and its row says what it carried.
FILES_OF_META = Fragment(
    "(SELECT array_agg(f ->> 'name') FROM jsonb_array_elements(CASE jsonb_typeof("
    "meta -> 'attachments') WHEN 'array' THEN meta -> 'attachments' ELSE '[]' END) f)"
)
# The newest $2 inbox rows (of status $1; NULL: any), $3 characters of each text for its
# excerpt, each with its trace and the outcomes before `butlers retry` queued it again.
# The newest $2 inbox messages (of status $1; NULL: any; older than id $4 when given), their
# text's first $3 characters.
OPERATOR_INBOX = f"""
    WITH page AS (
        SELECT id, channel, source_id, sender_name, subject, conversation, status,
               routed_to, classified_via, attempts, error, received_at, finished_at,
               left(text, $3) AS text_head, length(text) AS text_chars,
               (meta ->> 'album_of')::bigint AS album_of, {TRACE_OF_CONTEXT} AS traced,
               coalesce(meta -> 'retries', '[]'::jsonb) AS retries, {FILES_OF_META} AS files,
               reply_id, reply_status, reply_error
        FROM inbox LEFT JOIN LATERAL (  -- its reply's way out (a done message's may fail)
            SELECT o.id AS reply_id, o.status AS reply_status, left(o.error, 300) AS reply_error
            FROM outbox o
            WHERE o.inbox_id = inbox.id AND o.kind = 'reply' ORDER BY o.id DESC LIMIT 1
        ) AS reply_out ON true
        WHERE ($1::text IS NULL OR status = $1) AND ($4::bigint IS NULL OR id < $4)
        ORDER BY id DESC LIMIT $2
    )
    {WITH_ROUTED_TRACE}
"""
# The approvals the sessions of traces $1 asked for (a message's trace is its sessions').
OPERATOR_APPROVALS_BY_TRACE = f"""
    SELECT id, tool, status, {TRACE_OF_CONTEXT} AS trace_id FROM approvals
    WHERE {TRACE_OF_CONTEXT} = ANY($1::text[]) ORDER BY id
"""
# The newest $2 routes (to butler $1; NULL: any), older than the row ($3 created_at, $4 id).
OPERATOR_ROUTING_LOG = """
    SELECT id::text AS id, created_at, source_channel, source_id, routed_to,
           tool_name, prompt_summary, success, error, duration_ms, inbox_id,
           trace_id
    FROM routing_log
    WHERE ($1::text IS NULL OR routed_to = $1)
      AND ($3::timestamptz IS NULL OR (created_at, id) < ($3, $4::uuid))
    ORDER BY created_at DESC, id DESC LIMIT $2
"""
# Where a page of routing_log_list's ends: the row it names by id.
OPERATOR_ROUTING_LOG_ROW = "SELECT created_at, id FROM routing_log WHERE id = $1"
# The newest $2 outbox rows of statuses $1 (with ids below $4, when given), $3 characters of
# each text for its excerpt.
OPERATOR_OUTBOX = """
    SELECT id, kind, inbox_id, butler, channel, recipient, conversation, status,
           attempts, next_attempt_at, created_at, sent_at, error,
           left(text, $3) AS text_head, length(text) AS text_chars
    FROM outbox WHERE status = ANY($1::text[]) AND ($4::bigint IS NULL OR id < $4)
    ORDER BY id DESC LIMIT $2
"""
# A message to retry, locked until it is queued again (or refused).
OPERATOR_RETRY_LOCK = "SELECT status, attempts, error FROM inbox WHERE id = $1 FOR UPDATE"
# A failed outbox row sent again (an answer refused for good, e.g. a provider's daily quota,
# whose cause was fixed): due now, its earlier error kept in meta "retries".
OPERATOR_OUTBOX_RETRY = """
    UPDATE outbox SET
        status = 'pending', attempts = 0, error = NULL, next_attempt_at = now(),
        meta = jsonb_set(
            coalesce(meta, '{}'::jsonb), '{retries}',
            coalesce(meta->'retries', '[]'::jsonb) || jsonb_build_array(
                jsonb_build_object('retried_at', now(), 'error', error, 'attempts', attempts)))
    WHERE id = $1 AND status = 'failed'
    RETURNING id, channel, recipient, kind, meta->'retries' AS retries
"""
OPERATOR_OUTBOX_STATUS = "SELECT status FROM outbox WHERE id = $1"
# Queued again as if just received; its earlier outcome appended to meta "retries".
OPERATOR_REQUEUE = """
    UPDATE inbox SET
        status = 'queued', attempts = 0, error = NULL, reply = NULL,
        routed_to = NULL, classified_via = NULL, finished_at = NULL,
        meta = jsonb_set(
            meta, '{retries}',
            coalesce(meta->'retries', '[]'::jsonb) || jsonb_build_array(
                jsonb_build_object(
                    'retried_at', now(), 'status', status, 'error', error,
                    'routed_to', routed_to, 'classified_via', classified_via,
                    'attempts', attempts, 'finished_at', finished_at)))
    WHERE id = $1
    RETURNING id, status, meta->'retries' AS retries
"""

# -- the dashboard's pages (DashboardStore; its registry is REGISTRY, REGISTRY_BUTLER) ------

# One page of the inbox, newest first: $1 rows, $2 characters of each text for its one-line
# excerpt; filtered by status, channel, and ids below the previous page's.
DASHBOARD_MESSAGES = Filtered(
    head=f"""
    WITH page AS (
        SELECT id, channel, source_id, sender_name, subject, status, classified_via,
               routed_to, attempts, received_at, finished_at, left(error, 300) AS error,
               left(text, $2) AS text_head, length(text) AS text_chars,
               left(reply, $2) AS reply_head, length(reply) AS reply_chars,
               (meta ->> 'album_of')::bigint AS album_of, {TRACE_OF_CONTEXT} AS traced,
               {FILES_OF_META} AS files
        FROM inbox""",
    filters=("status = {}", "channel = {}", "id < {}"),
    tail=f"""ORDER BY id DESC LIMIT $1
    )
    {WITH_ROUTED_TRACE}""",
    fixed=2,
)
# One message, its texts up to $2 characters.
DASHBOARD_MESSAGE = f"""
    SELECT id, channel, external_id, source_id, sender_name, subject, conversation,
           status, classified_via, routed_to, attempts, received_at, finished_at,
           left(text, $2) AS text, length(text) AS text_chars,
           left(reply, $2) AS reply, left(error, $2) AS error,
           (meta ->> 'album_of')::bigint AS album_of, {TRACE_OF_CONTEXT} AS trace_id,
           coalesce(meta -> 'retries', '[]'::jsonb) AS retries, {FILES_OF_META} AS files
    FROM inbox WHERE id = $1
"""
# A message's routes, oldest first.
DASHBOARD_MESSAGE_ROUTES = """
    SELECT id::text AS id, created_at, routed_to, tool_name, prompt_summary,
           success, left(error, 2000) AS error, duration_ms, trace_id
    FROM routing_log WHERE inbox_id = $1 ORDER BY created_at LIMIT 20
"""
# What went out for a message.
DASHBOARD_MESSAGE_OUTBOX = """
    SELECT id, kind, butler, channel, status, attempts, created_at, sent_at,
           left(error, 2000) AS error
    FROM outbox WHERE inbox_id = $1 ORDER BY id LIMIT 20
"""
# What the sessions of trace $1 asked the owner for.
DASHBOARD_MESSAGE_APPROVALS = f"""
    SELECT id, tool, status, requested_at, decided_by FROM approvals
    WHERE {TRACE_OF_CONTEXT} = $1 ORDER BY id LIMIT 20
"""
# One page of the routing log, newest first ($1 rows); filtered by butler, outcome, and
# creation before the previous page's.
DASHBOARD_ROUTES = Filtered(
    head="""
    SELECT id::text AS id, created_at, source_channel, source_id, routed_to,
           tool_name, prompt_summary, success, left(error, 300) AS error,
           duration_ms, inbox_id, trace_id
    FROM routing_log""",
    filters=("routed_to = {}", "success = {}", "created_at < {}"),
    tail="ORDER BY created_at DESC LIMIT $1",
    fixed=1,
)
# Whether a dashboard session was signed out (in any switchboard process).
DASHBOARD_SIGNED_OUT = "SELECT EXISTS (SELECT 1 FROM dashboard_signed_out WHERE session_id = $1)"
# Sign-outs past their cookie's expiry no longer matter.
DASHBOARD_FORGET_SIGN_OUTS = "DELETE FROM dashboard_signed_out WHERE expires_at < now()"
DASHBOARD_SIGN_OUT = """
    INSERT INTO dashboard_signed_out (session_id, expires_at) VALUES ($1, $2)
    ON CONFLICT (session_id) DO NOTHING
"""
