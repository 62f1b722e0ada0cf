"""`butlers gateway`: one MCP server for a host (Claude Code, Claude Desktop), with every
butler and every `.mcp.json` server behind it as one compact suite tool, the detail loaded on
demand or activated into the tool list. A process of its own: it reaches the butlers through
the switchboard's registry over MCP and imports nothing of butlers.switchboard.

    config     gateway.toml | switchboard.config.json, and the `.mcp.json` of one child
    children   which MCP servers sit behind it (the registry's butlers, `.mcp.json` files)
    clients    one child: a process we start (stdio) or a server we reach (SSE / HTTP)
    summary    one-line summaries of the children's tools, for `introspect`
    server     the MCP server: suite tools, activate mode, gateway_status
    run        `butlers gateway`: assemble and serve, or print the token report

Nothing is imported here: a caller pays only for the modules it uses (the schema generator
reads config alone, without FastMCP).

Where this package sits among the others, and a message's path through them:
docs/architecture.md.
"""
