"""The Switchboard: the butler at the front door. A message's path, top to bottom:

    (intake)        butlers.modules.telegram, .email: a message is accepted into the inbox
    inbox           the durable inbox: stored before its channel is told, claimed in order
    worker          classify -> route -> reply, N at once, each conversation in order
    conversation    what a message follows: earlier exchanges for the prompts, thread affinity
    classifier      triage rules first, else a Claude Code session that calls `route`
    dispatch        what a classification session may route, and waiting for its routes
    route           one tool call forwarded to a butler, one routing_log row
    (connections)   butlers.mcp_connection.pool: the kept-open MCP connections route calls
                    through, one per butler
    replies         what the person reads, built from the butlers' answers
    outbox          every reply and notification, until its channel has taken it

Beside the path:

    registry        discover(): butler_registry in step with the config directory
    routing_store   the store of butler_registry and routing_log
    queries         every SQL statement of the stores (and the dashboard's), by name
    deliver         a butler's notification (its `notify`), through the outbox
    operator        inbox_list, routing_log_list, inbox_retry, outbox_list
    leadership      which of several switchboard processes runs the pollers and the outbox
    wakeups         LISTEN/NOTIFY between switchboard processes
    component       the Switchboard: builds these parts, opens and closes them in order
    tools           the switchboard's MCP tools, registered on the component's parts

Nothing is imported here: a module of the path costs only what it uses.

Where this package sits among the others, and a message's path through them:
docs/architecture.md.
"""
