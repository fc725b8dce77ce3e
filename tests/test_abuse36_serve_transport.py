"""`minillm serve` on a Unix domain socket (vLLM's --uds) and over TLS (vLLM's --ssl-* flags): real
servers answering through httpx, chat's and the monitor's clients reaching them, and bad paths refused
at start-up with one line and the CLI's status."""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_abuse29b_cli import one_line
from test_cli import REPO, STORIES, needs_stories, run_main
from test_server_helpers import started_url, stop_server, wait_for

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

COMPLETION = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _cert(subject, issuer, public_key, signing_key, is_ca: bool, serial: int):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(public_key).serial_number(serial)
               .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))
    if is_ca:
        builder = builder.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                        critical=True)
    else:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            signing_key.public_key()), critical=False)
    return builder.sign(signing_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_tls_files(directory: Path, serial: int = 2) -> dict[str, Path]:
    """A CA (ca.pem) and a server certificate it signed for 127.0.0.1 (cert.pem, key.pem), serial `serial`."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("minillm test CA", "minillm test CA", ca_key.public_key(), ca_key, True, 1)
    cert = _cert("127.0.0.1", "minillm test CA", key.public_key(), ca_key, False, serial)
    files = {"ca": directory / "ca.pem", "cert": directory / "cert.pem", "key": directory / "key.pem"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(_pem_key(key))
    return files


def start_serve(tmp_path: Path, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """`minillm serve stories260K FLAGS` in a process of its own, its output in serve.log."""
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "minillm.cli", "serve", str(STORIES), "--device", "cpu",
                                 "--served-model-name", "stories", "--disable-log-stats", *flags],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def stale_socket(path: Path) -> None:
    """A socket file nothing listens on, as a killed server leaves it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


@needs_stories
def test_uds_serves_health_and_completions(tmp_path, capsys):
    path = tmp_path / "s.sock"
    stale_socket(path)                  # left by an earlier server that was killed: replaced
    proc, log = start_serve(tmp_path, "--uds", str(path))
    try:
        url = started_url(proc, log, timeout=120)
        assert url == f"unix:{path}", log.read_text()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost",
                          timeout=60) as client:
            assert client.get("/health").status_code == 200
            response = client.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 8
        # chat --url unix:PATH reaches it through the same client code
        from minillm.chat_client import HttpChatBackend
        assert HttpChatBackend(url).model == "stories"
        _monitor_reads_stats(url)           # and monitor unix:PATH
        # a second server on the same path is refused before it loads anything; the first keeps serving
        status, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--uds", str(path))
        line = one_line(err)
        assert status == 1 and "another server is listening on it" in line and str(path) in line, line
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path))) as client:
            assert client.get("http://localhost/health").status_code == 200
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()
    assert not path.exists(), "the socket file outlived the server"


@needs_stories
def test_uds_with_two_api_servers_shares_one_socket(tmp_path):
    path = tmp_path / "m.sock"
    proc, log = start_serve(tmp_path, "--uds", str(path), "--api-server-count", "2")
    try:
        assert started_url(proc, log, timeout=120) == f"unix:{path}", log.read_text()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost",
                          timeout=60) as client:
            response = client.post("/v1/completions", json=COMPLETION)
            assert response.status_code == 200, response.text
        # both API servers hold the one listening socket (each accepts on it); the log's URL line is the
        # first one's, so the second may still be taking the socket over
        pids = _api_server_pids(log)
        assert wait_for(lambda: all(_holds_socket(pid, path) for pid in pids), timeout=120), log.read_text()
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()
    assert not path.exists()


def _api_server_pids(log: Path) -> list[int]:
    import re
    pids = [int(pid) for pid in re.findall(r"API server \d+ in process (\d+)", log.read_text())]
    assert len(pids) == 2, log.read_text()
    return pids


def _holds_socket(pid: int, path: Path) -> bool:
    """Whether process pid has a listening Unix socket bound to path open (from /proc/net/unix)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            inodes.add(os.readlink(fd).removeprefix("socket:[").removesuffix("]"))
        except OSError:
            continue
    with open(f"/proc/{pid}/net/unix") as table:
        return any(fields[-1] == str(path) and fields[6] in inodes and fields[3] == "00010000"   # __SO_ACCEPTCON
                   for fields in (line.split() for line in list(table)[1:]) if len(fields) >= 8)


def _served_serial(port: int) -> int:
    """The serial number of the certificate the server at 127.0.0.1:port presents (not verified)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


@needs_stories
def test_tls_serves_https_with_the_ca_given_and_refreshes_its_certificate(tmp_path, monkeypatch):
    files = make_tls_files(tmp_path)
    proc, log = start_serve(tmp_path, "--host", "127.0.0.1", "--port", "0", "--ssl-certfile", str(files["cert"]),
                            "--ssl-keyfile", str(files["key"]), "--enable-ssl-refresh")
    try:
        url = started_url(proc, log, timeout=120)
        assert url.startswith("https://127.0.0.1:"), log.read_text()
        ca = ssl.create_default_context(cafile=str(files["ca"]))
        assert httpx.get(f"{url}/health", verify=ca, timeout=30).status_code == 200
        response = httpx.post(f"{url}/v1/completions", json=COMPLETION, verify=ca, timeout=60)
        assert response.status_code == 200, response.text
        with pytest.raises(httpx.ConnectError):       # a client that does not trust the CA is refused
            httpx.get(f"{url}/health", verify=ssl.create_default_context(), timeout=30)
        with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP on the TLS port gets no HTTP answer
            httpx.get(url.replace("https://", "http://") + "/health", timeout=30)
        # chat --url https://... trusts $SSL_CERT_FILE, as httpx and the openai client do
        chat = subprocess.run([sys.executable, "-c", "from minillm.chat_client import HttpChatBackend; import sys; "
                               "print(HttpChatBackend(sys.argv[1]).model)", url], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO),
                                                           "SSL_CERT_FILE": str(files["ca"])})
        assert chat.stdout.strip() == "stories", chat.stderr
        # the monitor's client too (it reads no proxy settings from the environment, but this one)
        monkeypatch.setenv("SSL_CERT_FILE", str(files["ca"]))
        _monitor_reads_stats(url)
        # --enable-ssl-refresh: new certificate files are served to new connections
        port = int(url.rsplit(":", 1)[1])
        assert _served_serial(port) == 2
        (tmp_path / "fresh").mkdir()
        fresh = make_tls_files(tmp_path / "fresh", serial=3)
        os.replace(fresh["key"], files["key"])
        os.replace(fresh["ca"], files["ca"])
        os.replace(fresh["cert"], files["cert"])
        assert wait_for(lambda: _served_serial(port) == 3, timeout=30), log.read_text()
        fresh_ca = ssl.create_default_context(cafile=str(files["ca"]))
        assert httpx.get(f"{url}/health", verify=fresh_ca, timeout=30).status_code == 200
    finally:
        stop_server(proc)
    assert proc.returncode == 0, log.read_text()


def _monitor_reads_stats(url: str) -> None:
    """The monitor's LiveSource gets /v1/stats from url."""
    import asyncio

    from minillm.tui.client import LiveSource

    async def poll():
        source = LiveSource(url)
        async with source._client() as client:
            return await source._poll(client, 8)

    frame = asyncio.run(poll())
    assert "num_running" in frame.raw, frame.raw


@needs_stories
@pytest.mark.parametrize("flags, status, message", [
    (("--ssl-certfile", "{tmp}/missing.pem", "--ssl-keyfile", "{tmp}/missing.key"), 2,
     "Invalid value for '--ssl-certfile': {tmp}/missing.pem: no such file"),
    (("--ssl-certfile", "{cert}", "--ssl-keyfile", "{tmp}/missing.key"), 2,
     "Invalid value for '--ssl-keyfile': {tmp}/missing.key: no such file"),
    (("--ssl-certfile", "{cert}", "--ssl-keyfile", "{ca}"), 2,
     "Invalid value for '--ssl-certfile'"),
    (("--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{tmp}"), 2,
     "Invalid value for '--ssl-ca-certs': {tmp}: not a file"),
    (("--ssl-keyfile", "{key}"), 2, "--ssl-keyfile and --ssl-certfile go together: it takes effect with TLS"),
    (("--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-cert-reqs", "2"), 2,
     "--ssl-cert-reqs and --ssl-ca-certs go together: checking client certificates (2) needs the CA file"),
    (("--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-cert-reqs", "5"), 2,
     "'--ssl-cert-reqs': must be 0"),
    (("--uds", "{tmp}/no/such/dir/s.sock"), 1, "cannot listen on unix:{tmp}/no/such/dir/s.sock: no such directory"),
    (("--uds", "{cert}"), 1, "the path exists and is not a socket"),
    (("--uds", ""), 2, "'--uds': is empty"),
])
def test_bad_transport_flags_fail_at_start_with_one_line(tmp_path, capsys, flags, status, message):
    files = make_tls_files(tmp_path)
    values = {"tmp": str(tmp_path), "cert": str(files["cert"]), "key": str(files["key"]), "ca": str(files["ca"])}
    got, _, err = run_main(capsys, "serve", str(STORIES), "--device", "cpu", "--port", "0",
                           *(flag.format(**values) for flag in flags))
    line = one_line(err)
    assert got == status and message.format(**values) in line, line
    assert files["cert"].is_file()          # --uds on a file that is no socket left it alone


def test_monitor_with_tls_is_refused(capsys):
    status, _, err = run_main(capsys, "serve", "x", "--monitor", "--ssl-certfile", "c.pem")
    line = one_line(err)
    assert status == 2 and "--monitor and --ssl-certfile cannot be combined" in line, line


def test_server_urls_of_unix_sockets_are_taken():
    from minillm.urls import check_server_url, client_endpoint
    assert check_server_url("unix:/run/minillm.sock/v1", "--url") == "unix:/run/minillm.sock"
    assert client_endpoint("unix:/run/minillm.sock") == ("http://localhost", "/run/minillm.sock")
    assert client_endpoint("https://h:1") == ("https://h:1", None)
    with pytest.raises(ValueError, match="give unix:PATH"):
        check_server_url("unix:", "--url")
