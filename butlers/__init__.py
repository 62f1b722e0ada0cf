"""Butlers: a personal team of AI agents, each a long-running MCP server with its own database."""

__version__ = "0.1.0"
