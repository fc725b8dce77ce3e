"""The terminal side of `minillm chat`: keys typed while a reply streams, and prompts that keep them.

While a reply streams, the terminal is switched to no-echo, key-at-a-time input: a Ctrl-C then
leaves no `^C` inside the reply's words, and what is typed meanwhile is read here instead of
being lost (line editors such as readline take the terminal over at the next prompt and drop a
Ctrl-D typed before it). Complete lines are sent next, a partial line is put back at the prompt,
and a Ctrl-D on an empty line ends the chat after the reply.
"""
from __future__ import annotations

import os
import re
import select
import sys
from dataclasses import dataclass, field
from typing import Callable, TextIO

CTRL_D, CTRL_U, ESC = "\x04", "\x15", "\x1b"
# What a terminal acts on rather than draws, but for the tab and the line ends: C0 and C1 control
# characters and DEL (an ESC begins a sequence that can reset the terminal, switch its screen, set its title).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def is_terminal(stream) -> bool:
    """True when stream (sys.stdin, sys.stdout) is a terminal; False for a pipe, a file, or a
    stream that is closed or missing."""
    try:
        return stream is not None and stream.isatty()
    except (ValueError, OSError):
        return False


def terminal_safe(text: str) -> str:
    """TEXT as it may be written to a terminal: each control character but tab and line ends shown
    escaped (a reply sampled at a high temperature holds byte tokens such as ESC)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


@dataclass
class TypeAhead:
    """What the user typed while a reply was streaming."""

    lines: list[str] = field(default_factory=list)   # ended with Enter: sent in order
    partial: str = ""                                 # the unfinished line: shown at the next prompt
    is_eof: bool = False                              # Ctrl-D on an empty line: quit after these
    _escape: str = ""                                 # an escape sequence in progress (arrow keys)

    def feed(self, text: str) -> None:
        """Apply typed characters as a terminal in line mode would."""
        for ch in text:
            if self.is_eof:
                return
            if self._escape or ch == ESC:
                self._escape += ch
                # ESC [ params final-letter (CSI), or ESC and one more character
                if len(self._escape) > 1 and (self._escape[1] != "[" or ch.isalpha() or ch == "~"):
                    self._escape = ""
                continue
            if ch == CTRL_D:
                self.is_eof = not self.partial   # with text on the line, Ctrl-D does not end input
            elif ch in "\r\n":
                self.lines.append(self.partial)
                self.partial = ""
            elif ch in ("\x7f", "\b"):
                self.partial = self.partial[:-1]
            elif ch == CTRL_U:
                self.partial = ""
            elif ch == "\t" or ch.isprintable():
                self.partial += ch


class StreamingKeys:
    """A context in which the terminal does not echo and typed keys go to a TypeAhead (ttys only)."""

    def __init__(self, ahead: TypeAhead, stream: TextIO | None = None) -> None:
        self.ahead = ahead
        self.stream = stream or sys.stdin
        self._fd: int | None = None
        self._saved = None
        self._decoder = None

    def __enter__(self) -> StreamingKeys:
        try:
            import codecs
            import termios
            fd = self.stream.fileno()
            if not os.isatty(fd):
                return self
            self._saved = termios.tcgetattr(fd)
        except (ImportError, OSError, ValueError, AttributeError):   # not a terminal, or not POSIX
            return self
        quiet = list(self._saved)
        quiet[3] &= ~(termios.ICANON | termios.ECHO | termios.ECHOCTL)   # lflag; ISIG stays: Ctrl-C works
        quiet[6] = list(quiet[6])
        quiet[6][termios.VMIN], quiet[6][termios.VTIME] = 1, 0
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
        self._fd = fd
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        return self

    def poll(self) -> None:
        """Take in whatever has been typed, without waiting."""
        if self._fd is None:
            return
        while select.select([self._fd], [], [], 0)[0]:
            data = os.read(self._fd, 4096)
            if not data:         # the terminal went away: as good as Ctrl-D
                self.ahead.is_eof = True
                return
            self.ahead.feed(self._decoder.decode(data))

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        import termios
        try:
            self.poll()          # keys typed up to now must not reach the line editor unseen
        finally:
            termios.tcsetattr(self._fd, termios.TCSANOW, self._saved)
            self._fd = None


def read_with_type_ahead(prompt: str, ahead: TypeAhead, out: TextIO,
                         read_line: Callable[[str], str] = input) -> str:
    """The next line: one typed during the reply, else read at the prompt with the partial line put back."""
    if ahead.lines:
        line = ahead.lines.pop(0)
        out.write(prompt + line + "\n")
        out.flush()
        return line
    if ahead.is_eof:
        ahead.is_eof = False
        raise EOFError
    prefill, ahead.partial = ahead.partial, ""
    if not prefill:
        return read_line(prompt)
    readline = sys.modules.get("readline")
    if readline is not None and read_line is input:
        def insert() -> None:
            readline.insert_text(prefill)
            readline.redisplay()
        readline.set_pre_input_hook(insert)
        try:
            return read_line(prompt)
        finally:
            readline.set_pre_input_hook()
    out.write(prompt + prefill)
    out.flush()
    return prefill + read_line("")


def interrupted_line() -> str | None:
    """The text that was on the prompt line when Ctrl-C came (None when the line editor cannot say)."""
    readline = sys.modules.get("readline")
    try:
        return None if readline is None else readline.get_line_buffer()
    except Exception:   # a readline stand-in without the call
        return None
