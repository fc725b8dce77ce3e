"""The console script's entry (minillm/entry.py): Ctrl-C at any moment of start-up ends the command with
'minillm: interrupted' and status 130, never a traceback; each child process below is the entry as the
console script runs it."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from test_abuse23_cli import ENV, read_until
from test_cli import REPO, STORIES, needs_stories


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    """Python CODE in a fresh interpreter (sys.argv[1:] = ARGS), text out."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=ENV, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def test_the_console_script_is_the_entry():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"minillm": "minillm.entry:main"}


def test_the_entry_holds_sigint_and_imports_nothing_heavy_before_main():
    # What runs before the guard is in place can be interrupted anywhere: the package's __init__ and the
    # entry's first lines only, not SamplingParams (it was imported by `import minillm`), typer or numpy.
    result = run_child("import signal, sys\n"
                       "import minillm.entry\n"
                       "print(sorted(m for m in sys.modules if m.startswith(('minillm', 'typer', 'click', 'numpy'))))\n"
                       "print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['minillm', 'minillm.entry']", "True"]


def test_the_command_line_imported_as_a_library_leaves_sigint_alone():
    # The entry holds SIGINT back only once it runs: importing minillm.cli from a program does not.
    result = run_child("import signal\n"
                       "import minillm.cli\n"
                       "print(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n")
    assert (result.returncode, result.stdout) == (0, "False\n"), result.stderr


@pytest.mark.parametrize("module", ["minillm", "minillm.cli"])     # python -m minillm, python -m minillm.cli
def test_ctrl_c_raised_while_typer_imports_is_one_line_and_status_130(module):
    # Ctrl-C in the first tenth of a second (typer and click importing) printed a traceback of the imports.
    code = ("import runpy, sys\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'typer':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "sys.argv = ['minillm', '--help']\n"
            f"runpy.run_module({module!r}, run_name='__main__')\n")
    result = run_child(code)
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "minillm: interrupted\n")


def test_sigint_that_arrives_while_the_command_line_imports_is_held_until_the_imports_are_done():
    # A real SIGINT in the middle of typer's import: held back (the import goes on, and says so), then
    # raised in one place once the command line has been imported.
    code = ("import os, signal, sys\n"
            "import minillm.entry\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'typer':\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "            sys.stderr.write('typer imports on\\n')\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "sys.argv = ['minillm', 'generate', '--help']\n"
            "minillm.entry.main()\n")
    result = run_child(code)
    assert (result.returncode, result.stdout) == (130, "")
    assert result.stderr == "typer imports on\nminillm: interrupted\n"


def test_ctrl_c_that_python_ignores_in_a_callback_is_raised_again():
    # A Ctrl-C that lands in a weakref callback (as the import system's are) was printed as "Exception
    # ignored" with a traceback, and the command went on as if the key had not been pressed.
    code = ("import sys, weakref\n"
            "import minillm.entry, minillm.cli\n"
            "class Thing:\n"
            "    pass\n"
            "def interrupted(ref):\n"
            "    raise KeyboardInterrupt\n"
            "def check_model_name(model):\n"
            "    thing = Thing()\n"
            "    ref = weakref.ref(thing, interrupted)\n"
            "    del thing\n"
            "minillm.cli.check_model_name = check_model_name\n"
            "sys.argv = ['minillm', 'generate', 'no-such-model', '-p', 'hi']\n"
            "minillm.entry.main()\n")
    result = run_child(code)
    assert (result.returncode, result.stdout, result.stderr) == (130, "", "minillm: interrupted\n")


@needs_stories
def test_sigint_at_any_moment_once_the_entry_runs_ends_the_command_with_130():
    # Sent as soon as the guard is up, the signal lands wherever the child is by then: imports held back,
    # the command's own imports, reading its prompt from stdin or loading the model; each ends the same.
    code = ("import os, sys\n"
            "import minillm.entry\n"
            "os.write(2, b'guarded\\n')\n"
            "sys.argv = ['minillm', 'generate', sys.argv[1], '--device', 'cpu', '-p', '-']\n"
            "minillm.entry.main()\n")
    process = subprocess.Popen([sys.executable, "-c", code, str(STORIES)], cwd=REPO, env=ENV, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = read_until(process, process.stderr, b"guarded\n")
    process.send_signal(signal.SIGINT)
    # A signal that came just before the read of stdin began waits for the read to return.
    process.stdin.close()
    process.stdin = None
    out, err = process.communicate(timeout=120)
    stderr = (seen + err).decode()
    assert process.returncode == 130 and out == b"", stderr
    assert "Traceback" not in stderr and "ignored" not in stderr
    assert stderr.endswith("minillm: interrupted\n")


def test_an_error_after_start_up_is_unchanged_by_the_entry():
    result = run_child("import sys, minillm.entry\n"
                       "sys.argv = ['minillm', 'generate', '-p', 'hi']\n"
                       "minillm.entry.main()\n")
    assert result.returncode == 2 and "Missing argument 'model'" in result.stderr
    assert "Traceback" not in result.stderr
