"""Our outbound MCP connections: one JSON-RPC core, the transports it runs over, one pool.

    core.McpConnection        requests by id, answers, cancellation, the peer's requests
    core.Connection           what every kind below offers its owner (the one protocol)
    sse.SseConnection         MCP over HTTP+SSE (aiohttp): route's hop to every butler
    stdio.StdioConnection     MCP over a child process's stdin/stdout (the gateway's children)
    streamable.FastMcpConnection   any other transport, through FastMCP's client
    pool.McpConnections       kept-open connections by URL, re-opened once: route, a
                              butler's notify, the dashboard's fleet probe

Every one raises the same errors (butlers.errors.McpCallError and its subclasses). The
gateway's children (and through them a butler's tool servers) and the CLI's one-shot call
hold a single connection of their own instead of the pool: each reconnects, or not, its own
way. Nothing is imported here, so a caller pays only for the transport it uses.

Where this package sits among the others, and a message's path through them:
docs/architecture.md.
"""
