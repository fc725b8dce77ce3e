"""Leftovers: a Lark grammar that can never end, a choice list past the constraint bound, a string length
bound past llguidance's, a --json-schema file that is not UTF-8, and chat --url against a server that never answers."""
import re
import socket

import pytest

from minillm import chat_client
from minillm.lark_ending import start_can_never_end
from minillm.structured_output import MAX_CONSTRAINT_CHARS, StructuredOutputsError, StructuredOutputsParams
from test_cli import minillm

NEVER_ENDS = 'start: a\na: "x" a\n'


def test_a_lark_grammar_that_can_never_end_is_refused_as_its_gbnf_form_is():
    with pytest.raises(StructuredOutputsError, match="^grammar: invalid grammar: root can never end"):
        StructuredOutputsParams(grammar='root ::= a\na ::= "x" a\n')
    with pytest.raises(StructuredOutputsError, match="^grammar: invalid grammar: start can never end") as info:
        StructuredOutputsParams(grammar=NEVER_ENDS)
    assert info.value.field == "grammar"
    with pytest.raises(StructuredOutputsError, match="start can never end"):
        StructuredOutputsParams(grammar='?start: "<" b{2} ">"\nb: ("y" | "z") b\n%ignore " "\n')


@pytest.mark.parametrize("grammar", [
    'start: a\na: "x" a | "y"\n',
    'start: a*\na: "x" a\n',
    'start: a{0,3}\na: "x" a\n',
    'start: a~0..2\na: "x" a\n',
    'start: [a] "y"\na: "x" a\n',
    'start: a\na: "x" a\n   | %json {"type": "string"}\n',
    'start: a\na[max_tokens=5]: /x*/\n',
    'start: a\na: "x" a # c\n  | "y"\n',
    'start: a\na: "x" a | TEXT\nTEXT: /[a-z]+/\n',
])
def test_a_lark_grammar_that_can_end_is_taken(grammar):
    assert not start_can_never_end(grammar)
    assert StructuredOutputsParams(grammar=grammar).key[1] == grammar


def test_a_choice_list_is_held_to_the_constraint_bound_in_total():
    with pytest.raises(StructuredOutputsError, match=f"^choice: .* 200000 characters long together; at most "
                                                     f"{MAX_CONSTRAINT_CHARS}") as info:
        StructuredOutputsParams(choice=["x" * 200000])
    assert info.value.field == "choice"
    with pytest.raises(StructuredOutputsError, match="^choice: "):
        StructuredOutputsParams(choice=["x" * 1000] * 132)
    StructuredOutputsParams(choice=["x" * 1000] * 131)


@pytest.mark.parametrize("name", ["maxLength", "minLength"])
@pytest.mark.parametrize("bound", [10 ** 18, 2 ** 32, 1e20])
def test_a_string_length_bound_past_32_bits_names_the_keyword_and_the_bound(name, bound):
    with pytest.raises(StructuredOutputsError, match=f"^json: {name}={re.escape(repr(bound))} is past .* 4294967295") as info:
        StructuredOutputsParams(json={"type": "object", "properties": {"s": {"type": "string", name: bound}}})
    assert info.value.field == "json"
    assert "decimal literal" not in str(info.value)


def test_a_string_length_bound_of_32_bits_is_taken():
    StructuredOutputsParams(json={"type": "string", "maxLength": 2 ** 32 - 1})
    StructuredOutputsParams(json={"type": "object", "default": {"maxLength": 10 ** 18}})    # data, not a schema


def test_a_json_schema_file_that_is_not_utf8_is_a_usage_error_before_the_model_loads(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_bytes(b"\xff\xfe")
    result = minillm("generate", str(tmp_path / "no-such-model"), "--device", "cpu", "-p", "Hi",
                     "--json-schema", str(schema))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"minillm generate: error: --json-schema: {schema} is not UTF-8 text: invalid start byte at byte 0 "
        "(try 'minillm generate --help')"]


def test_chat_url_start_up_against_a_server_that_never_answers_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(chat_client, "STARTUP_READ_TIMEOUT_S", 0.2)
    with socket.socket() as listener:     # the kernel takes connections it is never asked to accept
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(RuntimeError) as info:
            chat_client.HttpChatBackend(url)
    assert str(info.value) == (f"the server at {url} took the connection but did not answer GET /v1/models "
                               "within 0.2 s")


def test_chat_url_replies_keep_the_whole_reply_timeout(monkeypatch):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    monkeypatch.setattr(chat_client, "STARTUP_READ_TIMEOUT_S", 0.2)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        backend = chat_client.HttpChatBackend(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=600.0)
    finally:
        server.shutdown()
        server.server_close()
    assert backend.model == "m" and backend.client.timeout.read == 600.0
