"""Server URLs as people type them, and the ones no client can connect to."""
from __future__ import annotations

import pytest
from test_cli import minillm

from minillm.urls import check_server_url, server_base_url


@pytest.mark.parametrize("typed,base", [
    ("localhost:8000", "http://localhost:8000"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
    ("https://example.org/v1/stats", "https://example.org"),
    ("http://[::1]:8000", "http://[::1]:8000"),
])
def test_a_server_url_is_its_root(typed, base):
    assert server_base_url(typed) == base == check_server_url(typed, "--url")


@pytest.mark.parametrize("url,reason", [
    ("http://[::1", "Invalid IPv6 URL"),
    ("http://127.0.0.1:99999", "Port out of range"),
    ("http://127.0.0.1:port", "Port could not be cast"),
    ("ftp://127.0.0.1:21", "give http://host:port"),
    ("http://:8000", "give http://host:port"),
    ("http://127.0.0.1:8000?x=1", "no query or fragment"),
    ("127.0.0.1:8000/v1#top", "no query or fragment"),
    ("http://127.0.0.1:8000/?", "no query or fragment"),
])
def test_a_url_no_client_can_connect_to_is_a_value_error_naming_the_option(url, reason):
    with pytest.raises(ValueError, match=f"--url: not a server URL: .*{reason}"):
        check_server_url(url, "--url")


@pytest.mark.parametrize("args,option", [
    (["chat", "--url", "http://[::1"], "--url"),
    (["monitor", "http://127.0.0.1:99999"], "URL"),
    (["monitor", "http://127.0.0.1:8000?x=1"], "URL"),
    (["router", "--prefill", "http://[::1", "--decode", "http://127.0.0.1:8001"], "--prefill"),
    (["router", "--prefill", "http://127.0.0.1:8001", "--decode", "http://127.0.0.1:65536"], "--decode"),
])
def test_the_commands_refuse_such_a_url_at_start(args, option):
    # chat and bench traced back (httpx.InvalidURL), the router answered every request with a 500,
    # the monitor retried forever.
    result = minillm(*args, stdin="")
    assert result.returncode == 2, (result.stdout, result.stderr)     # a usage error naming the flag
    assert f"Invalid value for '{option}': not a server URL" in result.stderr and "Traceback" not in result.stderr


def test_the_router_refuses_a_host_it_cannot_listen_on():
    result = minillm("router", "--prefill", "http://127.0.0.1:8001", "--decode", "http://127.0.0.1:8002",
                     "--host", "999.1.1.1")
    assert result.returncode == 1 and "minillm: error: cannot listen on 999.1.1.1" in result.stderr, result.stderr
