"""What people type to reach a server: its root URL (host:port, a base URL ending in /v1, a stats
URL) and its API key, and the URL as it may be shown (no password)."""
from __future__ import annotations

import os
import re
import ssl
from urllib.parse import urlsplit, urlunsplit

_HOST_PORT = re.compile(r"[\w.\-]+(:\d+)?(/|$)")    # host[:port][/path], as people type it


def http_url(host: str, port: int) -> str:
    """http://host:port, an IPv6 address in brackets (http://[::1]:8000)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# The server's own endpoints that a URL people copy may end in (a curl line's, a browser's, Prometheus'
# scrape target): the server is what is left. Another path is kept: a server behind a proxy may live under one.
ENDPOINT_SUFFIXES = ("/v1/stats/stream", "/v1/stats", "/v1/chat/completions", "/v1/completions", "/v1/models",
                     "/v1", "/metrics", "/health", "/ping", "/load", "/version")


def server_base_url(url: str) -> str:
    """The server's root: http:// when no scheme is given, no trailing slash, and no /v1 (the
    OpenAI base URL clients are told to use), /v1/stats (the monitor's), /metrics (Prometheus') or
    the URL of another endpoint of the server (/v1/chat/completions, as a curl line has it) at the end."""
    url = url.strip()
    if "://" not in url and _HOST_PORT.match(url):
        url = f"http://{url}"
    url = url.rstrip("/")
    for suffix in ENDPOINT_SUFFIXES:
        if url.endswith(suffix):
            return url.removesuffix(suffix)
    return url


def url_path(base_url: str) -> str:
    """The path of an http(s) server URL ("" for none, and for unix:PATH, whose path is a socket's)."""
    if base_url.startswith("unix:"):
        return ""
    try:
        return urlsplit(base_url).path.rstrip("/")
    except ValueError:
        return ""


def check_server_url(url: str, option: str) -> str:
    """server_base_url(url), or a ValueError naming option when it is no http(s) URL a client can
    connect to (a bad port, an unclosed IPv6 bracket, no host, a query or fragment the paths would follow)."""
    base = server_base_url(url)
    if base.startswith("unix:"):          # a server on a Unix socket (serve --uds PATH)
        if not unix_socket_path(base):
            raise ValueError(f"{option}: not a server URL: {url!r} (give unix:PATH, the path serve --uds took)")
        return base
    try:
        parts = urlsplit(base)
        port = parts.port             # ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        raise ValueError(f"{option}: not a server URL: {url!r} ({exc})") from None
    if port == 0:                     # serve --port 0 binds a free port; no client connects to port 0
        raise ValueError(f"{option}: not a server URL: {url!r} (port 0 is no server's port: give the port "
                         "the server printed at start-up)")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{option}: not a server URL: {url!r} (give http://host:port)")
    if parts.query or parts.fragment or "?" in base or "#" in base:
        raise ValueError(f"{option}: not a server URL: {url!r} (no query or fragment: give http://host:port)")
    return base


def unix_socket_path(base_url: str) -> str | None:
    """PATH of a server URL unix:PATH (serve --uds PATH), else None."""
    return base_url.removeprefix("unix:") if base_url.startswith("unix:") else None


def client_endpoint(base_url: str) -> tuple[str, str | None]:
    """(the http(s) base URL a client sends requests to, the Unix socket they go through or None)."""
    path = unix_socket_path(base_url)
    return ("http://localhost", path) if path is not None else (base_url, None)


def env_ssl_verify() -> ssl.SSLContext | bool:
    """The CAs a client trusts for https: $SSL_CERT_FILE or $SSL_CERT_DIR where set (as httpx reads them
    with trust_env, and the openai client through it), else True (certifi's)."""
    cafile, capath = os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None
    if cafile is None and capath is None:
        return True
    return ssl.create_default_context(cafile=cafile, capath=capath)


def tls_failure(exc: BaseException, shown_base_url: str) -> str | None:
    """What to tell the user of a connection whose TLS handshake failed, and what they can do about it
    (a private CA, a plain-http server given as https://); None when exc was no TLS failure."""
    error = _ssl_error(exc)
    return None if error is None else f"TLS with {shown_base_url} failed: {_tls_reason(error)}"


def _ssl_error(exc: BaseException | None) -> ssl.SSLError | None:
    """The ssl.SSLError behind a failed connection (httpx wraps it twice), if that is what it was."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ssl.SSLError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _tls_reason(error: ssl.SSLError) -> str:
    """Why the TLS handshake failed, and what the user can do about it."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return (f"{error.verify_message or error.reason}: a server with a private CA is trusted through "
                "$SSL_CERT_FILE (its CA's certificate)")
    if error.reason == "WRONG_VERSION_NUMBER":
        return "the server does not speak TLS: is it http://, not https://?"
    return str(error.reason or error)


def authorization_headers(api_key: str | None, option: str = "--api-key") -> dict[str, bytes]:
    """{"Authorization": b"Bearer KEY"} for a client of the server (none without a key): the key as
    UTF-8, as the server reads its own and curl sends it (httpx would encode a str as ASCII, and
    refused "clé"). A ValueError naming option for a key an HTTP header cannot carry: a control
    character (a line break), or spaces at its ends (the server strips them from what it is sent)."""
    if not api_key:
        return {}
    bad = next((c for c in api_key if (c < " " and c != "\t") or c == "\x7f"), None)
    if bad is not None:
        raise ValueError(f"{option} holds a control character ({bad!r}), which an HTTP header cannot carry; "
                         f"give the key alone")
    if api_key != api_key.strip(" \t"):
        raise ValueError(f"{option} starts or ends with a space, which an HTTP header cannot carry; give the key "
                         f"without it")
    try:       # surrogateescape: bytes of the command line that are not UTF-8 go as they were typed
        return {"Authorization": b"Bearer " + api_key.encode("utf-8", "surrogateescape")}
    except UnicodeEncodeError:
        raise ValueError(f"{option} is not valid Unicode (a lone surrogate)") from None


def shown_url(base_url: str) -> str:
    """base_url as it may be printed or drawn: a password in it becomes ***."""
    parts = urlsplit(base_url)
    if parts.password is None:
        return base_url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def check_credentials(base_url: str, api_key: str | None) -> None:
    """ValueError when base_url carries a user and password and an API key is given too: both go in
    the one Authorization header, where httpx puts the URL's Basic credentials over the key."""
    parts = urlsplit(base_url)
    if api_key and (parts.username or parts.password):
        raise ValueError(f"{shown_url(base_url)}: give the URL's user and password or --api-key, not both "
                         "(both go in the Authorization header)")
