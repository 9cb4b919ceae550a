"""Every line the CLI prints goes through here, and nothing here parses rich markup.

Lab names, host names, labels, errors, paths and tool output come from users and tools; a `[/x]`
in any of them must print as itself (rich would read it as a closing tag and crash), and so must
a `:ab:` (rich would print an emoji). So both consoles have markup and emoji codes off, and colour
is only ever added with `styled()`, which wraps a known string in a style without reading it.

Nor may their control sequences reach the terminal (a guest's ESC [ 2 J, an OSC that sets the
window title), nor a URL's password: both consoles are TextConsoles, which pass every piece of
text they render through lab.plaintext.printable and lab.redact.passwords, whatever printed it (a
line, a table cell, the progress display).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

from rich.console import Console, ConsoleOptions, JustifyMethod, RenderableType
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from lab import plaintext, redact
from lab.results import fmt  # noqa: F401 - the one number format, for the commands


class TextConsole(Console):
    """A Console whose rendered text never carries control characters nor a URL's password (its own
    styles and cursor moves are separate segments, untouched)."""

    def render_str(self, text: str, **kwargs: Any) -> Text:
        # before rich drops a BEL on its own, so that an OSC sequence it ends goes whole
        return super().render_str(plaintext.printable(text), **kwargs)

    def render(self, renderable: RenderableType, options: ConsoleOptions | None = None) -> Iterator[Segment]:
        for seg in super().render(renderable, options):
            if seg.control is None and (plaintext.has_controls(seg.text) or "://" in seg.text):
                yield Segment(redact.passwords(plaintext.printable(seg.text)), seg.style)
            else:
                yield seg


# Tables are wide; a pipe or CI log gets a fixed width rather than 80 columns of wrapping. No emoji
# codes either: ":ab:" in a fingerprint or a path is text, not 🆎.
out = TextConsole(highlight=False, markup=False, emoji=False, width=None if sys.stdout.isatty() else 160)
err = TextConsole(stderr=True, highlight=False, markup=False, emoji=False, soft_wrap=True)  # one line, never wrapped

VERDICT_STYLES = {"better": "green", "worse": "red", "same": "cyan"}
STATUS_STYLES = {"done": "green", "n/a": "yellow", "duplicate": "yellow"}


def styled(text: object, style: str = "") -> Text:
    """`text` as itself, in `style` ("" for none)."""
    return Text(plaintext.printable(text), style=style)


def line(*parts: object) -> Text:
    """One line from plain pieces and styled() pieces; plain pieces are text, never markup."""
    return Text.assemble(*(p if isinstance(p, Text) else plaintext.printable(p) for p in parts))


def say(*parts: object, soft_wrap: bool = False) -> None:
    out.print(line(*parts), soft_wrap=soft_wrap)


def warn(*parts: object) -> None:
    err.print(line(*parts))


def table(
    columns: Iterable[str],
    title: str | None = None,
    *,
    right: Iterable[str] = (),
    title_justify: JustifyMethod = "left",
) -> Table:
    """A table whose title and cells are text (the consoles do not read markup)."""
    right = set(right)
    t = Table(title=title, title_justify=title_justify)
    for col in columns:
        t.add_column(col, justify="right" if col in right else "left")
    return t


def duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


def clock(when: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(when))
