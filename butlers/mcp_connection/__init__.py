"""Our outbound MCP connections: one JSON-RPC core and the transports it runs over.

    core.McpConnection        requests by id, answers, cancellation, the peer's requests
    sse.SseConnection         MCP over HTTP+SSE (aiohttp): route's hop to every butler
    stdio.StdioConnection     MCP over a child process's stdin/stdout (the gateway's children)
    streamable.FastMcpConnection   any other transport, through FastMCP's client

Every one raises the same errors (butlers.errors.McpCallError and its subclasses). Nothing is
imported here, so a caller pays only for the transport it uses.
"""
