"""Server-sent event streams as minillm's clients (chat --url, the monitor) read them: lines split as
httpx splits them, within a bound on a line's length, and JSON payloads no parser call can break."""
from __future__ import annotations

import json
import re

_NEWLINE = re.compile(r"\r\n|\r|\n")     # the line ends of server-sent events


class LineTooLong(ValueError):
    """A line ran past the bound without its end."""


class LineSplitter:
    """Text chunks in, whole lines out, as Response.iter_lines splits them (a \\r\\n cut between two
    chunks is one line end); LineTooLong once a line runs past limit characters without its end
    (iter_lines gathers such a line without bound)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._pending: list[str] = []
        self._num_pending = 0
        self._is_cr_held = False

    def feed(self, text: str) -> list[str]:
        """The lines this chunk ends."""
        if self._is_cr_held:
            text, self._is_cr_held = "\r" + text, False
        if text.endswith("\r"):          # the first half of a \r\n, perhaps
            text, self._is_cr_held = text[:-1], True
        pieces = _NEWLINE.split(text)
        lines = []
        if len(pieces) > 1:
            lines = ["".join(self._pending) + pieces[0], *pieces[1:-1]]
            self._pending, self._num_pending = [], 0
        if pieces[-1]:
            self._pending.append(pieces[-1])
            self._num_pending += len(pieces[-1])
            if self._num_pending > self.limit:
                raise LineTooLong(f"a line over {self.limit} characters")
        return lines

    def flush(self) -> list[str]:
        """The last line, when the text ended without a line end."""
        if not self._pending and not self._is_cr_held:
            return []
        line = "".join(self._pending)
        self._pending, self._num_pending, self._is_cr_held = [], 0, False
        return [line]


def loads(text: str):
    """json.loads; a ValueError saying why for JSON Python cannot read whole, which json.loads lets
    out as RecursionError (nesting past the stack) or a bare ValueError (an integer past Python's
    limit on digits), naming neither the text nor JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None
    except ValueError:
        raise ValueError("JSON with an integer too long to read") from None
