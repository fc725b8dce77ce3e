"""The engine core's ipc sockets bind under a deep $TMPDIR too (their paths must fit sun_path)."""
from __future__ import annotations

import os
import tempfile

import zmq

from minillm.engine_core.client import socket_dir


def test_a_deep_temporary_directory_moves_the_sockets_to_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = socket_dir("output-3")
    try:
        assert os.path.dirname(path) == "/tmp" and os.path.basename(path).startswith("minillm-core-")
        with zmq.Context() as ctx, ctx.socket(zmq.PULL) as sock:      # it binds
            sock.bind(f"ipc://{path}/output-3")
    finally:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)
    assert not any(p.name.startswith("minillm-core-") for p in deep.iterdir())   # the one tried there is gone


def test_a_short_temporary_directory_is_used(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = socket_dir("output-0")
    assert os.path.dirname(path) == str(tmp_path)
    os.rmdir(path)
