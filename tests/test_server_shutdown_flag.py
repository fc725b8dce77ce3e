"""The shutdown flag the signal handlers set: a second signal inside the first handler must not hang."""
import dis
import signal
import sys
import threading

import uvicorn

from minillm.server.app import _Server
from minillm.server.serving import ShutdownFlag


def test_a_second_signal_inside_the_first_handlers_set_does_not_hang():
    flag = ShutdownFlag()
    server = _Server(uvicorn.Config(app=lambda scope, receive, send: None), flag)
    nested = []

    def tracer(frame, event, arg):
        # At the last line of the flag's set() (where a threading.Event holds its lock) the second
        # signal's handler runs, as Python runs a handler between two bytecodes.
        if frame.f_code is ShutdownFlag.set.__code__:
            last = max(line for _, line in dis.findlinestarts(frame.f_code) if line is not None)

            def in_set(frame, event, arg):
                if event == "line" and frame.f_lineno == last and not nested:
                    nested.append(True)
                    server.handle_exit(signal.SIGTERM, None)
                return in_set
            return in_set
        return None

    def first_signal():
        sys.settrace(tracer)
        try:
            server.handle_exit(signal.SIGINT, None)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=first_signal, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the second handler waited on the first one's lock"
    assert nested and flag.is_set() and server.should_exit
