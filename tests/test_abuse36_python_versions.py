"""The code runs on every Python that pyproject.toml's requires-python admits (3.10 and later).

Run on a newer interpreter, these read every module statically for what 3.10 lacks (syntax, builtins,
stdlib names added later) and what 3.12 and 3.13 removed.
"""
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("minillm", "tui", "benchmarks", "tests")
# The oldest Python pyproject.toml admits: what the code is read as.
OLDEST = tuple(int(x) for x in re.search(r'requires-python = ">=(\d+)\.(\d+)"',
                                          (REPO / "pyproject.toml").read_text()).groups())

# Builtins that Python 3.10 does not have: a module using one must bind it itself (a backport's import).
NEW_BUILTINS = {"ExceptionGroup", "BaseExceptionGroup", "PythonFinalizationError"}
# Standard-library names added in 3.11 or later, as module -> names.
NEW_STDLIB = {
    "typing": {"Self", "Never", "LiteralString", "assert_never", "assert_type", "reveal_type", "Required",
               "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform", "get_overloads",
               "clear_overloads", "override", "TypeAliasType", "get_protocol_members", "is_protocol",
               "TypeIs", "ReadOnly", "NoDefault"},
    "datetime": {"UTC"},
    "enum": {"StrEnum", "ReprEnum", "EnumCheck", "FlagBoundary", "verify", "member", "nonmember", "global_enum",
             "show_flag_values", "EnumType"},
    "asyncio": {"TaskGroup", "timeout", "timeout_at", "Timeout", "Runner", "Barrier", "BrokenBarrierError",
                "eager_task_factory", "create_eager_task_factory", "QueueShutDown"},
    "itertools": {"batched"},
    "contextlib": {"chdir"},
    "hashlib": {"file_digest"},
    "operator": {"call"},
    "math": {"cbrt", "exp2", "sumprod", "fma"},
    "logging": {"getLevelNamesMapping", "getHandlerByName", "getHandlerNames"},
    "re": {"NOFLAG"},
    "inspect": {"markcoroutinefunction", "getasyncgenstate", "getasyncgenlocals", "BufferFlags"},
    "os": {"process_cpu_count"},
    "sys": {"exception", "activate_stack_trampoline", "monitoring", "_is_gil_enabled"},
    "copy": {"replace"},
    "warnings": {"deprecated"},
    "types": {"get_original_bases"},
}
NEW_MODULES = {"tomllib", "wsgiref.types"}
# Removed in 3.12 (distutils, imp, asyncore, asynchat, smtpd) and 3.13 (PEP 594's dead batteries, lib2to3).
REMOVED_MODULES = {"distutils", "imp", "asyncore", "asynchat", "smtpd", "aifc", "audioop", "cgi", "cgitb", "chunk",
                   "crypt", "imghdr", "mailcap", "msilib", "nis", "nntplib", "ossaudiodev", "pipes", "sndhdr", "spwd",
                   "sunau", "telnetlib", "uu", "xdrlib", "lib2to3"}




def _bound_names(tree: ast.AST) -> set[str]:
    """Names a module binds anywhere: imports, assignments, definitions."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound


def _module_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> standard-library module for the modules NEW_STDLIB lists, as `import x [as y]` binds them."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in NEW_STDLIB:
                    aliases[a.asname or a.name] = a.name
    return aliases


def _imported_modules(node: ast.AST) -> list[str]:
    """The absolute module names an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def version_problems(source: str) -> list[str]:
    """What in a module's source needs a Python newer than 3.10, or one older than 3.12 / 3.13."""
    tree = ast.parse(source, feature_version=OLDEST)
    problems = []
    bound = _bound_names(tree)
    aliases = _module_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in NEW_BUILTINS \
                and node.id not in bound:
            problems.append(f"line {node.lineno}: builtin {node.id} is new in 3.11")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr in NEW_STDLIB[aliases[node.value.id]]:
            problems.append(f"line {node.lineno}: {aliases[node.value.id]}.{node.attr} is new in 3.11+")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in NEW_STDLIB:
            problems += [f"line {node.lineno}: {node.module}.{a.name} is new in 3.11+"
                         for a in node.names if a.name in NEW_STDLIB[node.module]]
        for name in _imported_modules(node):
            if name in NEW_MODULES:
                problems.append(f"line {node.lineno}: module {name} is new in 3.11+")
            elif name.split(".")[0] in REMOVED_MODULES:
                problems.append(f"line {node.lineno}: module {name} is gone from 3.12 / 3.13")
    return problems + _fstring_quote_reuse(source)


def _fstring_quote_reuse(source: str) -> list[str]:
    """f-strings that reuse their own quote inside a replacement field (PEP 701: 3.12+ only)."""
    if sys.version_info < (3, 12):
        return []   # older tokenizers reject such an f-string outright: ast.parse has failed already
    problems, stack = [], []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.FSTRING_START:
            quote = re.sub(r"^[A-Za-z]*", "", tok.string)
            if any(quote.startswith(outer) for outer in stack):
                problems.append(f"line {tok.start[0]}: f-string reuses its enclosing quote {quote}")
            stack.append(quote)
        elif tok.type == tokenize.FSTRING_END:
            stack.pop()
        elif tok.type == tokenize.STRING and stack:
            quote = re.sub(r"^[A-Za-z]*", "", tok.string)[:3]
            quote = quote if quote in ('"""', "'''") else quote[0]
            if any(quote.startswith(outer) for outer in stack):
                problems.append(f"line {tok.start[0]}: string in an f-string reuses its enclosing quote {quote}")
    return problems


@pytest.mark.parametrize("folder", SOURCE_DIRS)
def test_modules_run_on_python_310_to_313(folder):
    """No module uses syntax, builtins or stdlib names newer than 3.10, or modules 3.12 / 3.13 removed."""
    problems = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        try:
            found = version_problems(path.read_text())
        except SyntaxError as exc:
            found = [f"line {exc.lineno}: {exc.msg} (read as Python {OLDEST[0]}.{OLDEST[1]})"]
        if found:
            problems[str(path.relative_to(REPO))] = found
    assert problems == {}


@pytest.mark.parametrize("source, found", [
    ("def f(e):\n    return isinstance(e, BaseExceptionGroup)\n", "builtin BaseExceptionGroup"),
    ("from typing import Self\n", "typing.Self"),
    ("import datetime as dt\nx = dt.UTC\n", "datetime.UTC"),
    ("import tomllib\n", "module tomllib"),
    ("import pipes\n", "module pipes"),
    ("import itertools\nitertools.batched([], 2)\n", "itertools.batched"),
])
def test_checker_finds_what_310_lacks(source, found):
    """The checker names each kind of problem it looks for."""
    assert any(found in p for p in version_problems(source))


def test_checker_accepts_a_bound_backport():
    """A builtin a module imports itself (the exceptiongroup backport on 3.10) is no problem."""
    source = ("import sys\nif sys.version_info < (3, 11):\n    from exceptiongroup import BaseExceptionGroup\n"
              "def f(e):\n    return isinstance(e, BaseExceptionGroup)\n")
    assert version_problems(source) == []


def test_checker_reads_syntax_as_310():
    """Syntax newer than 3.10 (except*) is a SyntaxError when read as 3.10."""
    with pytest.raises(SyntaxError):
        version_problems("try:\n    pass\nexcept* ValueError:\n    pass\n")


@pytest.mark.skipif(sys.version_info < (3, 12), reason="only 3.12+ tokenizes an f-string that reuses its quote")
def test_checker_finds_fstring_quote_reuse():
    """f"{d["k"]}" parses on 3.12 but not on 3.10 or 3.11."""
    assert version_problems('d = {}\nx = f"{d["k"]}"\n') != []
    assert version_problems("d = {}\nx = f\"{d['k']}\"\n") == []
    assert version_problems('d = {}\nx = f"""{d["k"]}"""\n') == []
