"""llama.cpp's GBNF grammars (`root ::= ...`) as llguidance Lark grammars with GBNF's meaning.

GBNF matches characters: a rule is a sequence of characters, and any split of the text between
the rules that matches is taken. llguidance's lexer is greedy instead (a lexeme goes on while the
next byte extends it), so a GBNF rule turned into a Lark terminal changes the language: in
llama.cpp's arithmetic.gbnf a term ends in optional whitespace ([ \\t\\n]*) before a required
"\\n", and as one terminal it takes that newline too, leaving no sentence at all. Here every rule
stays a Lark rule and every character is a lexeme of its own (a literal's characters one by one,
a character class or `.` one character), so the Earley parser splits the text as GBNF does.

    gbnf_to_lark('root ::= [a-z]+ ws "\\n"\\nws ::= [ \\t\\n]*')
    -> 'start: /[a-z]/+ ws "\\n"\\nws: /[\\x{20}\\x{9}\\x{A}]/*\\n'

A grammar llama.cpp would refuse (an unknown escape, an undefined rule, a rule that can never end)
is a ValueError that says where.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_NAME = re.compile(r"[A-Za-z0-9_-]+")
_PLAIN = re.compile(r"[A-Za-z0-9]")


@dataclass
class Node:
    """One GBNF expression: kind is lit (chars), class (ranges, negated), any, ref (name),
    seq / alt (items), rep (items[0], low, high: None for no upper bound)."""

    kind: str
    items: list
    name: str = ""
    negated: bool = False
    low: int = 0
    high: int | None = None


class _Parser:
    """A recursive-descent reader of GBNF text, as llama.cpp's grammar parser reads it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, message: str):
        line = self.text.count("\n", 0, self.pos) + 1
        column = self.pos - (self.text.rfind("\n", 0, self.pos) + 1) + 1
        raise ValueError(f"{message} at line {line}, column {column}")

    def peek(self, n: int = 1) -> str:
        return self.text[self.pos:self.pos + n]

    def skip(self, newlines: bool) -> None:
        """Skip spaces and comments (and newlines where the grammar may go on past them)."""
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c in " \t" or (newlines and c in "\r\n"):
                self.pos += 1
            elif c == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            else:
                return

    def rules(self) -> dict[str, Node]:
        rules: dict[str, Node] = {}
        self.skip(True)
        while self.pos < len(self.text):
            name = self.name()
            self.skip(False)
            if self.peek(3) != "::=":
                self.fail(f"expected '::=' after the rule name {name!r}")
            self.pos += 3
            self.skip(True)
            if name in rules:
                self.fail(f"the rule {name!r} is defined twice")
            rules[name] = self.alternatives(nested=False)
            if self.peek() not in ("", "\r", "\n"):
                self.fail(f"unexpected {self.peek()!r}")
            self.skip(True)
        return rules

    def name(self) -> str:
        match = _NAME.match(self.text, self.pos)
        if match is None:
            self.fail(f"expected a rule name, got {self.peek()!r}")
        self.pos = match.end()
        return match.group()

    def alternatives(self, nested: bool) -> Node:
        options = [self.sequence(nested)]
        while True:
            if not nested:                     # a line that opens with "|" goes on with the rule
                start = self.pos
                self.skip(True)
                if self.peek() != "|":
                    self.pos = start
            if self.peek() != "|":
                return options[0] if len(options) == 1 else Node("alt", options)
            self.pos += 1
            self.skip(True)
            options.append(self.sequence(nested))

    def sequence(self, nested: bool) -> Node:
        items: list[Node] = []
        while True:
            c = self.peek()
            if c == '"':
                items.append(self.literal())
            elif c == "[":
                items.append(self.char_class())
            elif c == ".":
                self.pos += 1
                items.append(Node("any", []))
            elif c == "(":
                self.pos += 1
                self.skip(True)
                items.append(self.alternatives(nested=True))
                if self.peek() != ")":
                    self.fail("expected ')'")
                self.pos += 1
            elif c and _NAME.match(c):
                items.append(Node("ref", [], name=self.name()))
            elif c and c in "*+?{":
                self.fail(f"{c!r} follows nothing to repeat")
            else:
                return items[0] if len(items) == 1 else Node("seq", items)
            self.skip(nested)
            if self.peek() and self.peek() in "*+?{":
                items[-1] = self.repetition(items[-1])
                self.skip(nested)

    def repetition(self, item: Node) -> Node:
        c = self.peek()
        self.pos += 1
        if c != "{":
            low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            return Node("rep", [item], low=low, high=high)
        self.skip(True)
        low = high = self.integer()
        self.skip(True)
        if self.peek() == ",":
            self.pos += 1
            self.skip(True)
            high = self.integer() if self.peek().isdigit() else None
            self.skip(True)
        if self.peek() != "}":
            self.fail("expected '}'")
        self.pos += 1
        if high is not None and high < low:
            self.fail(f"the repetition {{{low},{high}}} has its upper bound below its lower one")
        return Node("rep", [item], low=low, high=high)

    def integer(self) -> int:
        match = re.compile(r"[0-9]+").match(self.text, self.pos)
        if match is None:
            self.fail("expected a number")
        self.pos = match.end()
        return int(match.group())

    def literal(self) -> Node:
        self.pos += 1
        chars = []
        while self.peek() != '"':
            if not self.peek():
                self.fail("unterminated string")
            chars.append(self.char())
        self.pos += 1
        return Node("lit", chars)

    def char_class(self) -> Node:
        self.pos += 1
        negated = self.peek() == "^"
        self.pos += negated
        ranges = []
        while self.peek() != "]":
            if not self.peek():
                self.fail("unterminated character class")
            low = self.char()
            high = low
            if self.peek() == "-" and self.peek(2)[1:] not in ("]", ""):
                self.pos += 1
                high = self.char()
                if high < low:
                    self.fail(f"the range {low!r}-{high!r} ends before it starts")
            ranges.append((low, high))
        self.pos += 1
        if not ranges and not negated:
            self.fail("the character class [] matches no character")
        return Node("class", ranges, negated=negated)

    def char(self) -> str:
        c = self.text[self.pos]
        if c != "\\":
            self.pos += 1
            return c
        escape = self.peek(2)[1:]
        if escape in _ESCAPES:
            self.pos += 2
            return _ESCAPES[escape]
        if escape not in _HEX_DIGITS:
            self.fail(f"unknown escape \\{escape}")
        digits = self.text[self.pos + 2:self.pos + 2 + _HEX_DIGITS[escape]]
        if len(digits) != _HEX_DIGITS[escape] or not all(d in "0123456789abcdefABCDEF" for d in digits):
            self.fail(f"\\{escape} takes {_HEX_DIGITS[escape]} hexadecimal digits")
        code = int(digits, 16)
        if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            self.fail(f"\\{escape}{digits} is not a character")
        self.pos += 2 + len(digits)
        return chr(code)


def _regex_char(c: str) -> str:
    return c if _PLAIN.fullmatch(c) else f"\\x{{{ord(c):X}}}"


def _lark(node: Node, names: dict[str, str], top: bool = False) -> str:
    """node in Lark syntax: one lexeme per character."""
    kind = node.kind
    if kind == "lit":
        text = " ".join(json.dumps(c, ensure_ascii=False) for c in node.items) or '""'
        return text if len(node.items) < 2 else f"({text})"
    if kind == "class":
        ranges = "".join(_regex_char(lo) + (f"-{_regex_char(hi)}" if hi != lo else "") for lo, hi in node.items)
        return "/(?s:.)/" if not ranges else f"/[{'^' if node.negated else ''}{ranges}]/"
    if kind == "any":
        return "/(?s:.)/"
    if kind == "ref":
        return names[node.name]
    if kind == "seq":
        return "(" + " ".join(_lark(item, names) for item in node.items) + ")" if node.items else '""'
    if kind == "alt":
        text = " | ".join(_lark(item, names) for item in node.items)
        return text if top else f"({text})"
    inner = _lark(node.items[0], names)
    inner = f"({inner})" if node.items[0].kind == "rep" else inner
    suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((node.low, node.high))
    return inner + (suffix or f"{{{node.low},{'' if node.high is None else node.high}}}")


def _lark_names(rules: dict[str, Node]) -> dict[str, str]:
    """A Lark rule name for each GBNF name (lowercase, unique; root is start)."""
    names, used = {"root": "start"}, {"start"}
    for name in rules:
        if name == "root":
            continue
        base = re.sub(r"[^a-z0-9_]", "_", name.lower())
        base = base if base[0].isalpha() else "r" + base
        lark, n = base, 1
        while lark in used:
            n += 1
            lark = f"{base}_{n}"
        names[name] = lark
        used.add(lark)
    return names


def _refs(node: Node):
    if node.kind == "ref":
        yield node.name
    elif node.kind in ("seq", "alt", "rep"):
        for item in node.items:
            yield from _refs(item)


def _can_end(node: Node, ending: set[str]) -> bool:
    """Whether node matches some finite text, given the rules known to."""
    if node.kind == "ref":
        return node.name in ending
    if node.kind == "seq":
        return all(_can_end(item, ending) for item in node.items)
    if node.kind == "alt":
        return any(_can_end(item, ending) for item in node.items)
    if node.kind == "rep":
        return node.low == 0 or _can_end(node.items[0], ending)
    return True


def ending_rules(uses: dict[str, set[str]], can_end: Callable[[str, set[str]], bool]) -> set[str]:
    """The rules that can end (match some finite text), where can_end(name, ending) says whether a rule
    does once the rules in `ending` do and uses[name] are the rules it refers to. A rule is looked at
    again only when a rule it refers to is found to end (a sweep over all rules until none changes took
    a minute on a chain of 10,000 rules)."""
    users: dict[str, set[str]] = {name: set() for name in uses}
    for name, refs in uses.items():
        for ref in refs:
            users[ref].add(name)
    ending: set[str] = set()
    todo = list(uses)
    while todo:
        name = todo.pop()
        if name not in ending and can_end(name, ending):
            ending.add(name)
            todo.extend(users[name] - ending)
    return ending


def _check(rules: dict[str, Node]) -> None:
    if "root" not in rules:
        raise ValueError("no rule named root (the rule a GBNF grammar starts from)")
    for name, body in rules.items():
        for ref in _refs(body):
            if ref not in rules:
                raise ValueError(f"the rule {name!r} refers to {ref!r}, which is not defined")
    ending = ending_rules({name: set(_refs(body)) for name, body in rules.items()},
                          lambda name, ending: _can_end(rules[name], ending))
    if "root" not in ending:
        raise ValueError("root can never end: every text it starts goes on forever (a rule that always "
                         "refers to itself again)")


def gbnf_to_lark(text: str) -> str:
    """The Lark grammar (llguidance's syntax) for a GBNF grammar, or a ValueError saying what is wrong."""
    try:
        rules = _Parser(text).rules()
        _check(rules)
        names = _lark_names(rules)
        return "".join(f"{names[name]}: {_lark(body, names, top=True)}\n" for name, body in rules.items())
    except RecursionError:
        raise ValueError("the grammar nests groups or rules too deeply") from None
