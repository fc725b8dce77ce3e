"""The engine core apart from the API server: its own process, joined by ZeroMQ (as vLLM's EngineCoreProc).

    messages.py          the msgspec structs both sides send
    core.py              EngineCore (token outputs, no text) and the core process's loop
    client.py            the API server's end: spawn, sockets, a thread that reads the core and sees it die
    output_processor.py  the API server's detokenizer: token ids -> RequestOutputs, stop strings -> stops
    heap.py              the start-up heap frozen for the garbage collector (the core and the API servers)
"""
