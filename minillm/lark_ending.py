"""Whether a Lark grammar's start rule can never end (every text it starts goes on forever).

llguidance takes such a grammar (`start: a`, `a: "x" a`) and lets a model write to its token limit;
GBNF's conversion (gbnf.py) refuses it. This reads the rules of a Lark grammar in llguidance's syntax
and finds the rules that match some finite text. It answers True only for a grammar it reads whole:
anything it does not know (a terminal, a subgrammar, %json, a rule with attributes) counts as text
that ends, so a grammar that can end is never reported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from minillm.gbnf import ending_rules

_TOKEN = re.compile(r"""
    (?P<space>[ \t\r]+|\\\n)
  | (?P<newline>\n)
  | (?P<comment>(?://|\#)[^\n]*)
  | (?P<string>"(?:\\.|[^"\\\n])*"i?)
  | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
  | (?P<special><\[[^\]\n]*\]>|<[^\s<>]+>)
  | (?P<directive>%[A-Za-z_]+)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_-]*)
  | (?P<number>[0-9]+)
  | (?P<range>\.\.)
  | (?P<op>[:|()\[\]?*+{},~.@=])
""", re.VERBOSE)


# Directives that open a statement of their own (%json and %regex are items of a rule).
_STATEMENTS = ("%ignore", "%import", "%llguidance", "%declare", "%override", "%extend")


class _Unread(Exception):
    """A part of the grammar this reader does not know: it reports nothing."""


@dataclass
class _Token:
    kind: str
    text: str
    is_line_start: bool


def _tokens(text: str) -> list[_Token]:
    """The grammar's tokens, %-directives' {...} bodies as one token each."""
    out, pos, is_line_start = [], 0, True
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise _Unread
        kind, pos = m.lastgroup, m.end()
        if kind == "newline":
            is_line_start = True
            continue
        if kind in ("space", "comment"):
            continue
        if kind == "directive":
            pos = _skip_braces(text, pos)
        out.append(_Token(kind, m.group(), is_line_start))
        is_line_start = False
    return out


def _skip_braces(text: str, pos: int) -> int:
    """The end of a directive's JSON {...} body starting after pos (pos itself when it has none)."""
    start = len(text) - len(text[pos:].lstrip(" \t"))
    if start >= len(text) or text[start] != "{":
        return pos
    depth, i, is_in_string = 0, start, False
    while i < len(text):
        c = text[i]
        if is_in_string:
            i += 2 if c == "\\" else 1
            is_in_string = c != '"'
            continue
        is_in_string = c == '"'
        depth += {"{": 1, "}": -1}.get(c, 0)
        i += 1
        if depth == 0:
            return i
    raise _Unread


def _definitions(tokens: list[_Token]) -> dict[str, list[list[_Token]]]:
    """Each rule's bodies (a rule defined twice has both); terminals and statements are left out."""
    rules: dict[str, list[list[_Token]]] = {}
    body: list[_Token] | None = None
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok.is_line_start and (tok.kind == "name" or tok.text in _STATEMENTS):
            head = _head_length(tokens, i) if tok.kind == "name" else 0
            if head:
                name = tok.text.lstrip("?!")
                is_rule = name.lstrip("_")[:1].islower() and head == 2   # one with [attributes] or .priority ends
                body = rules.setdefault(name, []) if is_rule else None
                if body is not None:
                    body.append([])
                    body = body[-1]
                i += head
                continue
            if tok.kind == "directive":
                body = None
                i += 1
                continue
        if body is not None:
            body.append(tok)
        i += 1
    return rules


def _head_length(tokens: list[_Token], i: int) -> int:
    """How many tokens open a definition at i (`name:`, `name.2:`, `name[...]:`), 0 when none does."""
    j = i + 1
    if j + 1 < len(tokens) and tokens[j].text == "." and tokens[j + 1].kind == "number":
        j += 2
    if j < len(tokens) and tokens[j].text == "[":
        while j < len(tokens) and tokens[j].text != "]":
            j += 1
        j += 1
    return j - i + 1 if j < len(tokens) and tokens[j].text == ":" else 0


class _Reader:
    """Reads one rule body into what it needs to end: a set of alternatives, each a set of rule names."""

    def __init__(self, tokens: list[_Token], rule_names: set[str]) -> None:
        self.tokens, self.pos, self.rule_names = tokens, 0, rule_names

    def peek(self) -> str | None:
        return self.tokens[self.pos].text if self.pos < len(self.tokens) else None

    def take(self) -> _Token:
        if self.pos >= len(self.tokens):
            raise _Unread
        self.pos += 1
        return self.tokens[self.pos - 1]

    def whole(self) -> list[frozenset[str]]:
        """The body's alternatives, each the rules all of which must end for it to end."""
        alts = self.alternatives()
        if self.pos != len(self.tokens):
            raise _Unread
        return alts

    def alternatives(self) -> list[frozenset[str]]:
        alts = self.sequence()
        while self.peek() == "|":
            self.take()
            alts += self.sequence()
        return alts

    def sequence(self) -> list[frozenset[str]]:
        alts = [frozenset()]
        while self.peek() not in (None, "|", ")", "]"):
            item = self.item()
            alts = [a | b for a in alts for b in item]
            if len(alts) > 64:
                raise _Unread
        return alts

    def item(self) -> list[frozenset[str]]:
        alts = self.atom()
        while self.peek() in ("?", "*", "+", "{", "~"):
            if self.repeats_at_least_once():
                continue
            alts = [frozenset()]
        return alts

    def repeats_at_least_once(self) -> bool:
        """Reads a repetition suffix: whether it asks for at least one copy."""
        op = self.take().text
        if op in ("?", "*"):
            return False
        if op == "+":
            return True
        if op == "~":
            low = self.take()
            if low.kind != "number":
                raise _Unread
            if self.peek() == "..":
                self.take()
                self.number()
            return int(low.text) > 0
        low = self.number() if self.peek() not in (",", "}") else 0
        if self.peek() == ",":
            self.take()
            if self.peek() != "}":
                self.number()
        if self.take().text != "}":
            raise _Unread
        return low > 0

    def number(self) -> int:
        tok = self.take()
        if tok.kind != "number":
            raise _Unread
        return int(tok.text)

    def atom(self) -> list[frozenset[str]]:
        tok = self.take()
        if tok.text in ("(", "["):
            alts = self.alternatives()
            if self.take().text != {"(": ")", "[": "]"}[tok.text]:
                raise _Unread
            return [frozenset()] if tok.text == "[" else alts
        if tok.kind == "string":
            if self.peek() == "..":
                self.take()
                if self.take().kind != "string":
                    raise _Unread
            return [frozenset()]
        if tok.text == "@":
            self.take()
            return [frozenset()]
        if tok.kind == "name" and tok.text in self.rule_names:
            return [frozenset([tok.text])]
        if tok.kind in ("name", "regex", "special", "directive"):
            return [frozenset()]
        raise _Unread


def start_can_never_end(text: str) -> bool:
    """Whether the Lark grammar's start rule matches no finite text (False when it is not read whole)."""
    try:
        rules = _definitions(_tokens(text))
        if "start" not in rules:
            return False
        names = set(rules)
        needs = {name: [alt for body in bodies for alt in _Reader(body, names).whole()]
                 for name, bodies in rules.items()}
    except (_Unread, RecursionError):
        return False
    uses = {name: set().union(*alts) for name, alts in needs.items()}
    return "start" not in ending_rules(uses, lambda name, ending: any(alt <= ending for alt in needs[name]))
