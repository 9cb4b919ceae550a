"""Text the lab did not write itself (a guest's or a tool's output, a results store, lab.toml) made
safe to show on a terminal or to put into one line of a file the lab renders.

A guest or a tool can print terminal control sequences: ESC [ 2 J clears the screen, ESC ] 52
writes the clipboard, ESC ] 0 sets the window title, a carriage return hides what came before it
on the line. None of that may reach the user's terminal raw (the lab often runs as root in
someone's shell), and a line break must not get out of a comment in a script or a Vagrantfile.
`printable` keeps the words and drops the rest; `one_line` also folds line breaks into spaces.
"""

from __future__ import annotations

import re

# ESC sequences, whole: CSI (ESC [ ... final), OSC and the other string commands (ESC ] ... BEL
# or ST; DCS, SOS, PM, APC), two-byte escapes (ESC + one character); the 8-bit CSI too. A string
# command without its terminator loses its ESC only: the text after it stays visible.
_SEQUENCE = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"
    r"|\x1b[\]PX^_][^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
    r"|\x1b[ -/]*[0-~]"
    r"|\x9b[0-?]*[ -/]*[@-~]"
)
# what is left of C0 and C1 but tab and line feed, and DEL
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_FOLD = re.compile(r"[\t\n]+")


def has_controls(text: str) -> bool:
    return _CONTROL.search(text) is not None


def printable(text: object) -> str:
    """`text` without terminal control sequences: ESC sequences dropped whole, CR LF and a lone CR
    read as a line break, any other control character shown as "?"."""
    s = str(text)
    if not has_controls(s):
        return s
    s = _SEQUENCE.sub("", s).replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub("?", s)


def one_line(text: object) -> str:
    """printable(`text`) as one line: line breaks and tabs become single spaces."""
    return _FOLD.sub(" ", printable(text)).strip()
