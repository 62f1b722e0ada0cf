"""Butlers: a personal team of AI agents, each a long-running MCP server with its own database.

The map of the parts, a message's path and a request's path: docs/architecture.md.
"""

__version__ = "0.1.0"
