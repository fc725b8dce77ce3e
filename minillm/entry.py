"""The `minillm` console script and `python -m minillm`: Ctrl-C at any moment of start-up ends the
command as it does later, with 'minillm: interrupted' and status 130, never a traceback.

Importing this module holds SIGINT back (pending) until main() has imported the command line
(typer, click and the rest): a Ctrl-C in between is raised there, in one place, not in the middle of
an import, where Python printed a traceback of the import system. Import it only to call main().
Before it, only the interpreter's own start-up and the package's light __init__ run.
"""
import sys

try:        # the C module: `import signal` runs Python code, which a Ctrl-C could interrupt
    import _signal
except ImportError:
    import signal as _signal

# Where threads have signal masks (not on Windows, where the try in main() is the only guard).
CAN_HOLD_SIGINT = hasattr(_signal, "pthread_sigmask")
if CAN_HOLD_SIGINT:
    _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})

import signal  # noqa: E402  (SIGINT is held first)
from collections.abc import Callable  # noqa: E402

INTERRUPTED = "minillm: interrupted"
STATUS_INTERRUPTED = 130          # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


def raise_ignored_interrupts(previous: Callable) -> Callable:
    """An unraisablehook over PREVIOUS for a Ctrl-C that came while Python ran a callback it cannot
    raise from (the import system's weakref callbacks, a __del__): that printed "Exception ignored"
    with a traceback and went on as if the key was never pressed. It is raised instead where the
    main thread's Python goes on, at the next call or return (a one-shot profile function)."""
    def hook(unraisable) -> None:
        if unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
            previous(unraisable)
            return
        profile_before = sys.getprofile()

        def raise_where_python_goes_on(frame, event, arg) -> None:
            if frame.f_code is hook.__code__:       # this hook itself returning
                return
            sys.setprofile(profile_before)
            raise KeyboardInterrupt

        sys.setprofile(raise_where_python_goes_on)
    return hook


def main(argv: list[str] | None = None) -> None:
    """Import and run the command line (minillm.cli.main); Ctrl-C at any point: one line, status 130."""
    sys.unraisablehook = raise_ignored_interrupts(sys.unraisablehook)
    try:
        try:
            from minillm.cli import main as run_command_line
        finally:
            if CAN_HOLD_SIGINT:      # a Ctrl-C held back until now raises KeyboardInterrupt here
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        run_command_line(argv)
    except KeyboardInterrupt:
        # While the command line imported, or while it reported an error or an earlier Ctrl-C.
        if argv is None:
            # The process winds down: another Ctrl-C ends it at once, by the signal, quietly.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        print(INTERRUPTED, file=sys.stderr)
        sys.exit(STATUS_INTERRUPTED)
