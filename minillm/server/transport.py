"""Where and how `minillm serve` listens: TCP or a Unix domain socket (vLLM's --uds), plain HTTP or
TLS (vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs, --ssl-ciphers and
--enable-ssl-refresh), with vLLM's names and defaults.

As vLLM's, the socket is bound before the model loads. A Unix socket's file is removed when the
server stops; one left by a server that was killed (nothing accepts on it) is replaced at the next
start, and one a live server listens on is an error, as a taken port is.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from typing import Any

from uvicorn.config import create_ssl_context

from minillm.server.http import ListeningSocket

logger = logging.getLogger("minillm.server")

# How often --enable-ssl-refresh looks at the certificate files (vLLM watches them through watchfiles).
SSL_REFRESH_POLL_S = 1.0
CERT_REQS = (int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED))


@dataclass(frozen=True)
class TransportOptions:
    """The listening socket and TLS of a server, as vLLM's flags of the same names set them."""

    uds: str | None = None                  # a Unix domain socket's path: host and port are then ignored
    ssl_keyfile: str | None = None          # the server's private key (PEM); may be in ssl_certfile instead
    ssl_certfile: str | None = None         # the server's certificate chain (PEM): TLS is on when given
    ssl_ca_certs: str | None = None         # the CAs client certificates are checked against
    ssl_cert_reqs: int = int(ssl.CERT_NONE)  # 0: no client certificate, 1: optional, 2: required
    ssl_ciphers: str | None = None          # OpenSSL cipher list (TLS 1.2 and below)
    enable_ssl_refresh: bool = False        # reload the key, certificate and CAs when their files change

    def __post_init__(self) -> None:
        if self.uds is not None and not self.uds.strip():
            raise ValueError("uds is empty; give the socket's path (or leave it out to listen on --host/--port)")
        if self.ssl_cert_reqs not in CERT_REQS:
            raise ValueError(f"ssl_cert_reqs must be 0 (no client certificate), 1 (optional) or 2 (required), "
                             f"got {self.ssl_cert_reqs}")
        if not self.is_tls:
            for name in ("ssl_keyfile", "ssl_ca_certs", "ssl_ciphers", "enable_ssl_refresh", "ssl_cert_reqs"):
                if getattr(self, name):
                    raise ValueError(f"{name} and ssl_certfile go together: it takes effect with TLS, which the "
                                     "certificate file turns on; give that too")
        if self.ssl_cert_reqs and not self.ssl_ca_certs:
            raise ValueError(f"ssl_cert_reqs and ssl_ca_certs go together: checking client certificates "
                             f"({self.ssl_cert_reqs}) needs the CA file to check them against; give that too")

    @property
    def is_tls(self) -> bool:
        """Whether the server speaks HTTPS."""
        return bool(self.ssl_certfile)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """uvicorn.Config's TLS settings (none for plain HTTP)."""
        if not self.is_tls:
            return {}
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile,
                "ssl_ca_certs": self.ssl_ca_certs, "ssl_cert_reqs": self.ssl_cert_reqs,
                "ssl_ciphers": self.ssl_ciphers}

    def check_tls_files(self) -> None:
        """A ValueError naming the option whose file is missing, unreadable or not what it should be
        (a key that does not match the certificate, a file that is not PEM), found before the model loads."""
        if not self.is_tls:
            return
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
            check_readable_file(name, getattr(self, name))
        try:
            load_ssl_context(self)
        except ssl.SSLError as exc:
            files = " and ".join(f"{n} {getattr(self, n)}" for n in ("ssl_certfile", "ssl_keyfile") if getattr(self, n))
            raise ValueError(f"ssl_certfile: {files} do not load as a certificate and its key: {exc}") from None
        except (ValueError, OSError) as exc:     # ssl_ca_certs that is no PEM, a cipher list OpenSSL refuses
            raise ValueError(f"ssl_ca_certs or ssl_ciphers refused: {exc}") from None


def check_readable_file(name: str, path: str | None) -> None:
    """A ValueError naming option NAME unless PATH (None: not given) is a readable file."""
    if path is None:
        return
    if not os.path.exists(path):
        raise ValueError(f"{name} {path}: no such file")
    if not os.path.isfile(path):
        raise ValueError(f"{name} {path}: not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{name} {path}: not readable")


def load_ssl_context(transport: TransportOptions) -> ssl.SSLContext:
    """The server's SSLContext, as uvicorn builds it from the same settings."""
    return create_ssl_context(transport.ssl_certfile, transport.ssl_keyfile, None, ssl.PROTOCOL_TLS_SERVER,
                              transport.ssl_cert_reqs, transport.ssl_ca_certs, transport.ssl_ciphers)


def bind_uds(path: str) -> socket.socket:
    """A Unix stream socket bound to PATH (not listening yet); a ValueError saying why it cannot be: no
    such directory, a file there that is no socket, a server listening on it. A socket file nothing
    listens on (a killed server's) is replaced."""
    where = f"cannot listen on unix:{path}"
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"{where}: no such directory {directory}")
    if os.path.lexists(path):
        _remove_stale_socket(path, where)
    sock = ListeningSocket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        # remove_uds removes this file (uvicorn may have closed the socket by then), not one bound there since
        sock.bound_file = (path, os.stat(path).st_ino)
    except OSError as exc:
        sock.close()
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    return sock


def _remove_stale_socket(path: str, where: str) -> None:
    """Remove PATH if it is a socket no server accepts on; a ValueError if it is anything else."""
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ValueError(f"{where}: the path exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        os.unlink(path)          # nothing listens: a socket left by a server that did not stop cleanly
        logger.info("removed the stale socket file %s", path)
        return
    except OSError as exc:
        if exc.errno != errno.EAGAIN:    # a full backlog: a server is there
            raise ValueError(f"{where}: {exc.strerror or exc}") from None
    finally:
        probe.close()
    raise ValueError(f"{where}: another server is listening on it")


def remove_uds(sock: socket.socket) -> None:
    """Remove the file of a Unix socket bind_uds bound, if it is still that socket's."""
    path, inode = getattr(sock, "bound_file", (None, None))
    with contextlib.suppress(OSError):
        if path is not None and os.stat(path).st_ino == inode:
            os.unlink(path)


def listen_url(sock: socket.socket, is_tls: bool) -> str:
    """How clients name a listening socket: unix:PATH, or http(s)://host:port (IPv6 in brackets)."""
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    scheme = "https" if is_tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def refresh_ssl_files(context: ssl.SSLContext, transport: TransportOptions,
                            poll_s: float = SSL_REFRESH_POLL_S) -> None:
    """--enable-ssl-refresh: reload the certificate chain (and the CAs) into the serving context when
    their files change; new connections get the new ones. A file that does not load is logged and
    the old one kept."""
    chain = [p for p in (transport.ssl_certfile, transport.ssl_keyfile) if p]
    cas = [transport.ssl_ca_certs] if transport.ssl_ca_certs else []
    seen = {path: _file_version(path) for path in chain + cas}
    while True:
        await asyncio.sleep(poll_s)
        changed = {path for path in seen if _file_version(path) != seen[path]}
        if not changed:
            continue
        try:
            if changed & set(chain):
                context.load_cert_chain(transport.ssl_certfile, transport.ssl_keyfile)
            if changed & set(cas):
                context.load_verify_locations(transport.ssl_ca_certs)
        except (ssl.SSLError, OSError) as exc:
            logger.error("the changed TLS files did not load (%s); serving the previous ones", exc)
            continue    # a half-written file: tried again once it changes more
        finally:
            seen.update({path: _file_version(path) for path in changed})
        logger.info("reloaded the TLS files %s", ", ".join(sorted(changed)))


def _file_version(path: str) -> tuple | None:
    """What tells a file's change: its inode, size and modification time (None while it is missing)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns
