"""A real FastMCP server (stdio: `python tests/fakes/lists_mcp.py`) whose prompts and resources
change while it runs, for the gateway's pass-through tests. Its tag (`LISTS_MCP_TAG`, default
"lists") is in what it answers, so two of them behind one gateway can be told apart.

  prompt   greet(name)          "Hello, <name>, from <tag>!"
  resource note://shared        "shared note of <tag>" (the same URI in every instance)
  resource note://<tag>/secret  the text of LISTS_MCP_SECRET (what a span must never hold)
  template note://<tag>/page/{n} "page <n> of <tag>"
  tool     add_prompt(name, text)    adds a prompt and sends prompts/list_changed
  tool     add_resource(uri, text)   adds a resource and sends resources/list_changed
  tool     exit()                    the process ends at once (a crashed child)
"""

from __future__ import annotations

import os

from fastmcp import Context, FastMCP
from fastmcp.prompts import Prompt
from fastmcp.resources import TextResource


def build_lists(tag: str, secret: str) -> FastMCP:
    mcp = FastMCP(tag)

    @mcp.prompt
    def greet(name: str) -> str:
        return f"Hello, {name}, from {tag}!"

    @mcp.resource("note://shared")
    def shared() -> str:
        return f"shared note of {tag}"

    @mcp.resource(f"note://{tag}/secret")
    def secret_note() -> str:
        return secret

    @mcp.resource(f"note://{tag}/page/{{n}}")
    def page(n: str) -> str:
        return f"page {n} of {tag}"

    @mcp.tool
    async def add_prompt(name: str, text: str, ctx: Context) -> str:
        mcp.add_prompt(Prompt.from_function(lambda: text, name=name))
        await ctx.session.send_prompt_list_changed()
        return "added"

    @mcp.tool
    async def add_resource(uri: str, text: str, ctx: Context) -> str:
        mcp.add_resource(TextResource(uri=uri, name=uri, text=text))  # type: ignore[arg-type]
        await ctx.session.send_resource_list_changed()
        return "added"

    @mcp.tool
    def exit() -> str:
        os._exit(3)

    return mcp


if __name__ == "__main__":
    tag = os.environ.get("LISTS_MCP_TAG", "lists")
    build_lists(tag, os.environ.get("LISTS_MCP_SECRET", "")).run(
        transport="stdio", show_banner=False
    )
