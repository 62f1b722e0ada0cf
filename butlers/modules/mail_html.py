"""An HTML mail as the text its reader sees: block elements become line breaks, and what a
mail program does not show (the head, scripts, elements hidden by an attribute, an inline
style or a <style> rule) is left out, so that a stranger's mail cannot show the owner one
thing and tell the model another. Linear in the HTML's length: the CSS is scanned, never
regex-searched."""

from __future__ import annotations

import re
from html.parser import HTMLParser


class _HTMLText(HTMLParser):
    """HTML mail as readable text: block elements become line breaks; what a mail program
    does not show is left out: the head (its title), scripts, styles, frames' fallbacks, and
    elements hidden by the `hidden` attribute, an inline style of display:none or
    visibility:hidden, or such a rule of a <style> for their class or id (`.x`, `div.x`,
    `#x`, not within @media) that comes before them (a stranger's attached mail showed the
    owner one thing and told the model another in them: a red team, and two reviews). Other
    ways of hiding text (a zero font size, white on white, other selectors) are not told."""

    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "table", "blockquote"}
    UNSHOWN = {"script", "style", "head", "title", "template", "iframe", "noembed", "noframes"}
    # Elements with no content (no end tag): hiding one hides nothing after it.
    VOID = {
        "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param",
        "source", "track", "wbr",
    }  # fmt: skip
    # A hidden <p> whose end tag is left out ends where a browser ends it: at the next p or
    # block (it cannot hold one). (Other implied ends, li's and td's, need their lists' and
    # tables' nesting: not told, their hidden element hides on to its end.)
    IMPLIED_END = {"p": BLOCKS | {"ul", "ol", "h5", "h6", "pre", "form", "section", "article"}}
    FOREIGN = {"svg", "math"}  # within them `<x/>` ends x, as the parser takes it
    # Their content is text to a browser, never tags (HTMLParser knew script and style only:
    # `<textarea></div></textarea>` closed a hidden div early for it, not for a browser).
    CDATA_CONTENT_ELEMENTS = (  # type: ignore[misc]  # (Final in typeshed; read as self.)
        "script", "style", "textarea", "title", "xmp", "iframe", "noembed", "noframes",
    )  # fmt: skip
    MAX_CSS_CHARS = 256 * 1024  # of <style> read for its hiding rules

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self.chars = 0  # of text data so far
        self._hidden: str | None = None  # the element whose content is not shown, while in it
        self._depth = 0  # of that tag, nested within itself
        self._foreign = 0  # svg and math elements open
        self._styling = False  # within a <style> (its rules are read, hidden or not)
        self._css: list[str] = []
        self._css_chars = 0
        self._hiding = _HidingRules()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "style":
            self._styling = True
        if tag in self.FOREIGN:
            self._foreign += 1
        if self._hidden is not None:
            if self._depth == 1 and tag in self.IMPLIED_END.get(self._hidden, ()):
                pass  # `<p hidden>one<p>two`: the second p ends the first, and is shown
            elif tag == self._hidden:
                self._depth += 1
                return
            elif tag == "body" and self._hidden == "head":  # a head never closed
                self._hidden = None
                return
            else:
                return
            self._hidden = None
        if tag in self.UNSHOWN or (tag not in self.VOID and self._hiding.hides(tag, attrs)):
            self._hidden, self._depth = tag, 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        # `<div style="display:none"/>`: a browser ignores the slash of an HTML element that
        # has content, and hides what follows; HTMLParser ended it at once. In svg and math
        # the slash does end it.
        self.handle_starttag(tag, attrs)
        if self._foreign or tag in self.FOREIGN:
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in self.FOREIGN and self._foreign:
            self._foreign -= 1
        if tag == "style" and self._styling:
            self._styling = False
            self._hiding.read("".join(self._css))
            self._css, self._css_chars = [], 0
        if self._hidden is not None:
            if tag == self._hidden:
                self._depth -= 1
                if not self._depth:
                    self._hidden = None
            return
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._styling:  # in the head, or hidden: a browser applies it all the same
            if self._css_chars < self.MAX_CSS_CHARS:
                self._css.append(data)
                self._css_chars += len(data)
        elif self._hidden is None:
            self.parts.append(data)
            self.chars += len(data)


_CSS_ESCAPE = re.compile(r"\\(?:([0-9a-fA-F]{1,6})[ \t\n]?|(.))", re.DOTALL)
_SIMPLE_SELECTOR = re.compile(r"([a-z][a-z0-9]*)?([.#])([\w-]+)", re.IGNORECASE)
_HTML_SPACE = re.compile(r"[ \t\n\f\r]+")  # what separates class names (not all of Unicode's)


def _css_plain(css: str, *, keep_blanks: bool = False) -> str:
    """CSS as it means: comments and HTML comment marks gone (a scan, not a lazy regex: an
    unclosed `/*` repeated made that quadratic), escapes decoded (`\\6e one` is "none"),
    lower case, no blanks (`keep_blanks`: runs of them as one, for selectors)."""
    kept, at = [], 0
    while (opened := css.find("/*", at)) >= 0:
        kept.append(css[at:opened])
        closed = css.find("*/", opened + 2)
        at = len(css) if closed < 0 else closed + 2
    kept.append(css[at:])

    def decoded(match: re.Match[str]) -> str:
        if match[1] is not None:
            code = int(match[1], 16)
            return chr(code) if 0 < code <= 0x10FFFF else ""
        return match[2]

    text = _CSS_ESCAPE.sub(decoded, "".join(kept).replace("<!--", " ").replace("-->", " "))
    return " ".join(text.lower().split()) if keep_blanks else "".join(text.lower().split())


def _display(css: str) -> bool | None:
    """What a block of declarations says of being shown: False (display:none or
    visibility:hidden), True (another display or visibility), None (nothing)."""
    plain = _css_plain(css)
    if "display:none" in plain or "visibility:hidden" in plain:
        return False
    if "display:" in plain or "visibility:" in plain:
        return True
    return None


def _screen_media(prelude: str) -> bool:
    """Whether an at-rule's prelude is `@media screen` or `@media all`, with no condition."""
    words = _css_plain(prelude, keep_blanks=True).split()
    return (
        len(words) >= 2
        and words[0] == "@media"
        and all(word in ("screen", "all", "only", ",") for word in words[1:])
    )


class _HidingRules:
    """The classes and ids a mail's <style> hides (`.preheader {display: none}`), by tag
    when its selector names one; a later rule that shows them again undoes it."""

    def __init__(self) -> None:
        self.hidden: set[tuple[str, str, str]] = set()  # (tag or "", "." or "#", name)

    def read(self, css: str) -> None:
        """The rules of `css` a screen applies, in a scan (a regex over rules tried every
        start of a style without braces: minutes for 256 KiB): those at the top, and within
        `@media screen` or `@media all`; not those of a conditional at-rule (a small
        screen's, print's: hiding what a desktop shows would drop the owner's words)."""
        depth, selector_from, body_from, nested = 0, 0, 0, False
        media = False  # within `@media screen { ... }`: its rules are top-level ones
        for at, char in enumerate(css):
            top = 1 if media else 0
            if char == "{":
                if depth == 0 and _screen_media(css[selector_from:at]):
                    media, depth, selector_from = True, 1, at + 1
                    continue
                depth += 1
                if depth == top + 1:
                    body_from = at + 1
                else:
                    nested = True
            elif char == "}" and depth:
                depth -= 1
                if depth == top:
                    if not nested:
                        self._rule(css[selector_from : body_from - 1], css[body_from:at])
                    selector_from, nested = at + 1, False
                elif media and depth == 0:
                    media, selector_from = False, at + 1
            elif char == ";" and depth == top:  # after a statement: `@import url(x);`
                selector_from = at + 1

    def _rule(self, selectors: str, body: str) -> None:
        shown = _display(body)
        if shown is None:
            return
        for selector in _css_plain(selectors, keep_blanks=True).split(","):
            simple = _SIMPLE_SELECTOR.fullmatch(selector.strip())
            if simple is None:
                continue
            key = (simple[1] or "", simple[2], simple[3])
            if shown:
                self.hidden.discard(key)
            else:
                self.hidden.add(key)

    def hides(self, tag: str, attrs: list[tuple[str, str | None]]) -> bool:
        """Whether an element is hidden: by an inline style, else by `hidden` or a rule for
        its class or id (an inline display:block shows it whatever they say)."""
        inline = None
        hidden = False
        for name, value in attrs:
            if name == "style" and value:
                inline = _display(value)
            elif name == "hidden":
                hidden = True
            elif name in ("class", "id") and value and self.hidden:
                names = _HTML_SPACE.split(value.strip()) if name == "class" else [value]
                kind = "." if name == "class" else "#"
                hidden = hidden or any(
                    (scope, kind, each.lower()) in self.hidden
                    for each in names
                    for scope in ("", tag)
                )
        return not inline if inline is not None else hidden


_HTML_CHUNK = 64 * 1024


def html_to_text(html: str, *, max_chars: int | None = None) -> str:
    """HTML as text. With `max_chars`, conversion stops once that much text was found (the
    rest would be cut anyway; converting takes ~0.6 s a MB)."""
    parser = _HTMLText()
    for start in range(0, len(html), _HTML_CHUNK):
        parser.feed(html[start : start + _HTML_CHUNK])
        if max_chars is not None and parser.chars >= max_chars:
            break
    parser.close()
    text = "".join(parser.parts)
    lines = [re.sub(r"[ \t\xa0]+", " ", line).strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
