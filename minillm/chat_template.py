"""Chat templates: compiled in a bounded sandbox and rendered as transformers' apply_chat_template
renders them (vLLM renders through it), with vLLM's shaping of OpenAI message content.

Imported only for chat: it needs jinja2.
"""
from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
import time
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.runtime
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.visitor import NodeTransformer

# What one render of a chat template may do. A template is code (a request's own, with
# --trust-request-chat-template, is anyone's): it must not keep a preprocessing thread for
# minutes nor build strings of gigabytes. Hugging Face templates loop over the messages a few
# times and build short strings; these bounds are far above what they use.
MAX_TEMPLATE_STEPS = 1_000_000     # loop iterations, calls and filters of one render, all together
MAX_TEMPLATE_ITEMS = 1 << 24       # characters (or items) of one string or list a template builds
MAX_TEMPLATE_WIDTH = 100_000       # an integer argument of a call or filter (a width, a count)
MAX_TEMPLATE_INT_BITS = 1 << 20    # bits of an integer a template computes (`*` or `**` of big ones is one long C call)
MAX_TEMPLATE_OUTPUT = 1 << 26      # characters one render writes
MAX_TEMPLATE_SECONDS = 10.0        # the backstop for work no count sees (comparing long strings...)
MACRO_CALL_STEPS = 10              # a macro call costs about ten loop iterations

# transformers' marker for continue_final_message: appended to the last message's text, rendered,
# and the text is cut where it lands.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# transformers' names of a message's reasoning (the first is the one templates read).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# A width or precision in a %-format or a str.format spec ('%9999999d', '{:>9999999}').
_FORMAT_WIDTH = re.compile(r"[%:][^\d%{}]{0,4}(\d+)(?:\.(\d+))?")

_budget = threading.local()


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """A render went past one of the bounds above."""


class TemplateTimeout(BaseException):
    """Raised into a render that ran past MAX_TEMPLATE_SECONDS (a BaseException, so that no
    `except Exception` on the way swallows it)."""


def _spend(steps: int = 1) -> None:
    left = getattr(_budget, "left", MAX_TEMPLATE_STEPS) - steps
    if left < 0:
        raise TemplateLimitError(f"the template ran more than {MAX_TEMPLATE_STEPS} steps (loop iterations, "
                                 f"calls and filters)")
    _budget.left = left


def _refuse_size(what: str = "str") -> None:
    raise TemplateLimitError(f"the template built a {what} of more than {MAX_TEMPLATE_ITEMS} items")


def _check_size(value):
    """value, or TemplateLimitError when it is a string or list past MAX_TEMPLATE_ITEMS."""
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_TEMPLATE_ITEMS:
        _refuse_size(type(value).__name__)
    return value


def _check_args(args) -> None:
    """Refuse integer arguments past MAX_TEMPLATE_WIDTH (they size what a call builds) and
    format strings with widths past it."""
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > MAX_TEMPLATE_WIDTH:
            raise TemplateLimitError(f"the template passed {arg}, past the bound of {MAX_TEMPLATE_WIDTH}")


def _check_format(fmt) -> None:
    """Refuse a format string whose widths or precisions are past MAX_TEMPLATE_WIDTH."""
    if isinstance(fmt, str) and ("%" in fmt or ":" in fmt):
        for match in _FORMAT_WIDTH.finditer(fmt):
            _check_args([int(n) for n in match.groups() if n])


def _check_growth(name: str, text, args) -> None:
    """Refuse a str method or filter whose result would pass MAX_TEMPLATE_ITEMS, before it is built:
    replace (an empty pattern matches everywhere), join, indent and expandtabs multiply."""
    if name == "replace" and isinstance(text, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        grow = text.count(args[0]) * max(len(args[1]) - len(args[0]), 0)
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        sep = text if isinstance(text, str) else ""
        grow = len(sep) * len(args[0]) + sum(len(x) for x in args[0] if isinstance(x, str))
    elif name in ("indent", "expandtabs") and isinstance(text, str):
        width = next((a for a in args if isinstance(a, int) and not isinstance(a, bool)), 8)
        grow = width * text.count("\n" if name == "indent" else "\t")
    else:
        return
    if len(text if isinstance(text, str) else "") + grow > MAX_TEMPLATE_ITEMS:
        _refuse_size()


def _counted(iterable):
    """A loop's iterable, each step spent from the render's budget."""
    for item in iterable:
        _spend()
        yield item


def _counted_range(*args):
    """The sandbox's range(), each step spent from the render's budget."""
    return _counted(safe_range(*args))


def _concat(*parts) -> str:
    """Jinja's `~`, with the size of what it builds bounded."""
    if sum(len(p) for p in parts if isinstance(p, str)) > MAX_TEMPLATE_ITEMS:
        _refuse_size()
    return _check_size("".join(str(p) for p in parts))


def _check_int_bits(left, right, power: bool) -> None:
    """Refuse `left * right` (or `left ** right` with power) on integers when the result would pass
    MAX_TEMPLATE_INT_BITS: one such operation on big integers is a C call no deadline stops."""
    if not (isinstance(left, int) and isinstance(right, int)) or abs(left) <= 1:
        return
    bits = abs(left).bit_length() * abs(right) if power else abs(left).bit_length() + abs(right).bit_length()
    if bits > MAX_TEMPLATE_INT_BITS:
        raise TemplateLimitError(f"the template computes an integer of more than {MAX_TEMPLATE_INT_BITS} bits")


class _BoundLoopsAndConcat(NodeTransformer):
    """Rewrites a parsed template so that every {% for %} steps through _counted and every `~`
    goes through _concat."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = jinja2.nodes.Call(jinja2.nodes.Name("__minillm_counted", "load"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return jinja2.nodes.Call(jinja2.nodes.Name("__minillm_concat", "load"), list(node.nodes), [], None, None)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox (immutable), with each render's work and sizes bounded."""

    intercepted_binops = frozenset(["+", "*", "**", "%"])

    def _parse(self, source, name, filename):
        return _BoundLoopsAndConcat().visit(super()._parse(source, name, filename))

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                        and len(seq) * times > MAX_TEMPLATE_ITEMS:
                    raise TemplateLimitError(f"the template repeats a sequence past {MAX_TEMPLATE_ITEMS} items")
            _check_int_bits(left, right, power=False)
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(right) > 256 and abs(left) > 1:
                raise TemplateLimitError("the template raises an integer to a power past 256")
            _check_int_bits(left, right, power=True)
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                    and len(left) + len(right) > MAX_TEMPLATE_ITEMS:
                _refuse_size(type(left).__name__)
        elif operator == "%":
            _check_format(left)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):   # noqa: N805 (jinja's signature)
        _spend(MACRO_CALL_STEPS if isinstance(__obj, jinja2.runtime.Macro) else 1)
        _check_args(args)
        _check_args(kwargs.values())
        # A str method (the sandbox wraps format and format_map): 'x'.ljust(...), '{:>9}'.format(...)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if isinstance(owner, str):
            if __obj.__name__ in ("format", "format_map"):
                _check_format(owner)
            _check_growth(__obj.__name__, owner, args)
        return _check_size(super().call(__context, __obj, *args, **kwargs))


def _bounded_filter(name: str, func):
    """A filter that spends a step and refuses oversized arguments and results."""
    skip = 2 if getattr(func, "jinja_pass_arg", None) is not None else 1   # (context,) value, arguments...

    @functools.wraps(func)
    def bounded(*args, **kwargs):
        _spend()
        _check_args(args[skip:])
        _check_args(kwargs.values())
        value = args[skip - 1] if len(args) >= skip else None
        if name == "format":
            _check_format(value)
        elif name == "join":
            _check_growth("join", args[skip] if len(args) > skip else "", [value])
        else:
            _check_growth(name, value, args[skip:])
        return _check_size(func(*args, **kwargs))
    return bounded


class _GenerationTag(jinja2.ext.Extension):
    """transformers' {% generation %} ... {% endgeneration %} (it marks the assistant's tokens for
    training): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' tojson: Jinja's own escapes HTML characters, which templates do not want.
    if isinstance(indent, int) and indent > 64:      # each line of the JSON gets it
        raise TemplateLimitError("the template indents JSON by more than 64 spaces")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    # A directive writes up to a dozen times its length ('%c'), in one C call.
    if isinstance(fmt, str) and len(fmt) > MAX_TEMPLATE_ITEMS // 64:
        raise TemplateLimitError(f"the template passed strftime_now a format of more than "
                                 f"{MAX_TEMPLATE_ITEMS // 64} characters")
    return datetime.now().strftime(fmt)


def _lipsum(n=5, html=True, min=20, max=100):   # noqa: A002 (Jinja's names)
    from jinja2.utils import generate_lorem_ipsum
    _check_args([n * max])
    _spend(n)
    return generate_lorem_ipsum(n, html, min, max)


@functools.lru_cache(maxsize=32)
def compile_chat_template(source: str):
    """A Jinja template compiled in the bounded sandbox, with the helpers transformers gives chat
    templates (raise_exception, strftime_now, tojson without HTML escaping, loop controls,
    {% generation %})."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["tojson"] = _bounded_filter("tojson", _tojson)
    env.globals.update(range=_counted_range, lipsum=_lipsum, raise_exception=_raise_exception,
                       strftime_now=_strftime_now, __minillm_counted=_counted, __minillm_concat=_concat)
    return env.from_string(source)


# ---- vLLM's content format: does the template read a message's content as a list of parts? ----

def _unwrapped(node):
    """node seen through filters, tests and slices (messages | reverse, messages[1:])."""
    while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or \
            (isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)):
        node = node.node
    return node


def _names_of(node) -> set[str]:
    """The variable a loop or assignment reads, seen through filters, tests and slices ({} if none)."""
    node = _unwrapped(node)
    return {node.name} if isinstance(node, jinja2.nodes.Name) else set()


def _content_of(node) -> set[str]:
    """The variable whose 'content' a loop reads (message.content, message['content'], filtered)."""
    node = _unwrapped(node)
    if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
        return _names_of(node.node)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const) \
            and node.arg.value == "content":
        return _names_of(node.node)
    return set()


@functools.lru_cache(maxsize=32)
def reads_content_parts(source: str) -> bool:
    """Whether a template loops over a message's content, as vLLM detects it (then vLLM passes
    content as a list of {"type": "text", "text": ...} parts, the "openai" format; else as one
    string, parts joined by newlines)."""
    try:
        ast = jinja2.Environment(extensions=[_GenerationTag, jinja2.ext.loopcontrols]).parse(source)
    except jinja2.exceptions.TemplateError:
        return False
    lists = {"messages"}          # messages, and what is assigned from it (loop_messages = messages[1:])
    grew = True
    while grew:
        grew = False
        for assign in ast.find_all(jinja2.nodes.Assign):
            if _names_of(assign.node) & lists and isinstance(assign.target, jinja2.nodes.Name) \
                    and assign.target.name not in lists:
                lists.add(assign.target.name)
                grew = True
    loops = list(ast.find_all(jinja2.nodes.For))
    items = {loop.target.name for loop in loops
             if isinstance(loop.target, jinja2.nodes.Name) and _names_of(loop.iter) & lists}
    return any(_content_of(loop.iter) & items for loop in loops)


def shape_content(messages: list[dict], as_parts: bool) -> list[dict]:
    """Messages of an OpenAI request (content a string, None, or a list of text parts
    {"type": "text", "text": ...}) shaped as vLLM hands them to the template: the parts as a list
    when the template reads parts (as_parts), else joined by newlines; no content is "" or [].
    A tool's text parts are always joined, as vLLM joins them. Joined parts leave out the empty ones, as
    vLLM's string format drops them (a tool's parts in the "openai" format are joined whole)."""
    out = []
    for message in messages:
        content = message.get("content")
        parts = [] if content is None else [content] if isinstance(content, str) else [p["text"] for p in content]
        if not as_parts:
            shaped = "\n".join(text for text in parts if text)
        elif message.get("role") == "tool":
            shaped = "\n".join(parts)
        else:
            shaped = [{"type": "text", "text": text} for text in parts]
        out.append({**message, "content": shaped})
    return out


def _alias_reasoning(message: dict) -> dict:
    """transformers' reasoning aliases: `thinking` and `reasoning_content` from whichever is set."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(messages: list[dict]) -> str:
    """Append CONTINUE_TAG to the last message's text (its last text part); return that text."""
    final = messages[-1].get("content")
    if final is None:
        raise ValueError('continue_final_message: the last message has no "content" to continue')
    if isinstance(final, (list, tuple)):
        parts = [dict(p) if isinstance(p, dict) else p for p in final]
        for part in reversed(parts):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text = part["text"]
                part["text"] = text + CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message: the last message has no text to continue")
        messages[-1] = {**messages[-1], "content": parts}
        return text
    if not isinstance(final, str):
        raise ValueError("continue_final_message: the last message's content must be text")
    messages[-1] = {**messages[-1], "content": final + CONTINUE_TAG}
    return final


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered conversation cut where the last message's text ends, as transformers cuts it."""
    tag = CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the chat template does not render the last message's content")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()


def render(source: str, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
           variables: dict) -> str:
    """Render messages (dicts, None-valued keys already dropped) with a template's source as
    transformers does: tools and documents always defined (None when not given), reasoning aliased,
    continue_final_message cut at its tag; each render bounded (MAX_TEMPLATE_*)."""
    compiled = compile_chat_template(source)
    messages = [_alias_reasoning(m) for m in messages]
    final = None
    if continue_final_message:
        if "content" not in source:
            raise ValueError('continue_final_message: the chat template does not read "content"')
        final = _tag_final_message(messages)
    context = {"tools": None, "documents": None, **variables}
    text = _render_bounded(compiled, dict(context, messages=messages, add_generation_prompt=add_generation_prompt))
    return text if final is None else _cut_at_tag(text, final)


def _render_bounded(compiled, context: dict) -> str:
    """compiled.render(context) within the step budget, the output bound and the deadline."""
    _budget.left = MAX_TEMPLATE_STEPS
    with _deadline(MAX_TEMPLATE_SECONDS):
        chunks, size = [], 0
        for chunk in compiled.generate(context):
            size += len(chunk)
            if size > MAX_TEMPLATE_OUTPUT:
                raise TemplateLimitError(f"the template wrote more than {MAX_TEMPLATE_OUTPUT} characters")
            chunks.append(chunk)
        return "".join(chunks)


class _Watchdog:
    """One thread for the process that raises TemplateTimeout into a render past its deadline
    (Python code is interrupted between two bytecodes; the bounds above keep any one C call
    short). A thread a render would cost more than the render: about 0.5 ms to start."""

    POLL_S = 0.5                                   # how late past its deadline a render may be stopped

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deadlines: dict[int, float] = {}      # thread id -> time.monotonic() deadline
        self.fired: set[int] = set()               # threads a TemplateTimeout was raised into
        self.thread: threading.Thread | None = None

    def arm(self, seconds: float) -> None:
        """Stop this thread's render after `seconds`."""
        with self.lock:
            self.deadlines[threading.get_ident()] = time.monotonic() + seconds
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="minillm-template-watchdog", daemon=True)
                self.thread.start()

    def disarm(self) -> bool:
        """Forget this thread's deadline; True when it had passed (its TemplateTimeout raised, or
        about to be: see _take_pending_timeout)."""
        ident = threading.get_ident()
        with self.lock:
            self.deadlines.pop(ident, None)
            if ident not in self.fired:
                return False
            self.fired.discard(ident)
            return True

    def _run(self) -> None:
        while True:
            with self.lock:
                now = time.monotonic()
                for ident, at in list(self.deadlines.items()):
                    if at <= now:
                        del self.deadlines[ident]
                        self.fired.add(ident)
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident),
                                                                   ctypes.py_object(TemplateTimeout))
                wait = min([self.POLL_S, *(at - now for at in self.deadlines.values())])
            time.sleep(max(wait, 0.001))


_WATCHDOG = _Watchdog()


class _deadline:
    """Raises TemplateLimitError when the block runs past `seconds` (stopped by the watchdog)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self):
        _WATCHDOG.arm(self.seconds)
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        raised = kind is TemplateTimeout
        try:
            fired = _WATCHDOG.disarm()
        except TemplateTimeout:                    # raised while disarming
            fired, raised = _WATCHDOG.disarm() or True, True
        if fired and not raised:
            _take_pending_timeout()
        if fired:
            raise TemplateLimitError(f"the template ran longer than {self.seconds:g} s") from None
        return False


def _take_pending_timeout() -> None:
    """Let a TemplateTimeout the watchdog raised into this thread as the render ended surface here,
    not later in the caller's code. It is taken, not withdrawn: CPython 3.11 withdrawing it
    (PyThreadState_SetAsyncExc with NULL) leaves the interpreter's pending flag set for good, and
    a thread with a trace function then loops forever at its next call."""
    try:
        for _ in range(100_000):                  # CPython raises it at the first backward jump
            pass
    except TemplateTimeout:
        pass
