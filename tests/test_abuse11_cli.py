"""The CLI's file and path options, its server limits and its stdout as careless users give them:
recordings that are no recordings, output paths that cannot be written, infinite timeouts, a closed stdout."""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_cli import REPO, STORIES, minillm, needs_stories


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single stderr line of a failed command (asserting it failed without a traceback)."""
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    return line


def demo_copy(tmp_path: Path, name: str = "demo.jsonl.gz") -> Path:
    """A copy of the recording shipped with minillm."""
    from minillm.tui.app import demo_recording
    return Path(shutil.copy(demo_recording(), tmp_path / name))


# ---- monitor --replay ------------------------------------------------------------------------------

def broken_recordings(tmp_path: Path) -> list[tuple[Path, str]]:
    """(file, what the error must say) for recordings that cannot be read as one."""
    demo = demo_copy(tmp_path).read_bytes()
    damaged = bytearray(demo)
    damaged[300] ^= 0xFF                          # inside the deflate stream
    cases = [
        ("latin1.jsonl", b'{"t": 1.0, "stats": "caf\xe9"}\n', "a recording is UTF-8 text, but this file is not"),
        ("latin1.jsonl.gz", gzip.compress(b"caf\xe9\n"), "a recording is UTF-8 text, but this file is not"),
        ("plain.gz", b'{"t": 1.0}\n', "not a readable gzip file (Not a gzipped file"),
        ("cut.gz", demo[:200], "not a readable gzip file (Compressed file ended before the end-of-stream"),
        ("damaged.gz", bytes(damaged), "not a readable gzip file (Error -3 while decompressing data"),
    ]
    files = []
    for name, data, why in cases:
        (tmp_path / name).write_bytes(data)
        files.append((tmp_path / name, why))
    return files


def test_a_replay_file_that_is_no_readable_recording_is_one_line_naming_the_option_and_file(tmp_path):
    for path, why in broken_recordings(tmp_path):
        line = one_error_line(minillm("monitor", "--replay", str(path)))
        assert line.startswith(f"minillm: error: --replay: {path}: {why}"), line
    line = one_error_line(minillm("monitor", "--replay", str(tmp_path)))
    assert line == f"minillm: error: --replay {tmp_path} is a directory, not a recording"
    line = one_error_line(minillm("monitor", "--replay", str(tmp_path / "none.jsonl")))
    assert line == f"minillm: error: --replay: no such recording: {tmp_path / 'none.jsonl'}"


def test_load_recording_raises_value_errors_naming_the_file(tmp_path):
    from minillm.tui.recording import ReplaySource
    for path, why in broken_recordings(tmp_path):
        with pytest.raises(ValueError) as info:
            ReplaySource(path)
        assert str(info.value).startswith(f"{path}: {why}")


# ---- monitor --record ------------------------------------------------------------------------------

def test_a_record_path_that_cannot_be_written_is_one_line_naming_the_option_and_path(tmp_path):
    missing = tmp_path / "no" / "such" / "x.jsonl.gz"
    line = one_error_line(minillm("monitor", "--demo", "--record", str(missing)))
    assert line == f"minillm: error: --record: cannot write {missing}: No such file or directory"
    under_a_file = demo_copy(tmp_path) / "x.jsonl"
    line = one_error_line(minillm("monitor", "--demo", "--record", str(under_a_file)))
    assert line == f"minillm: error: --record: cannot write {under_a_file}: Not a directory"
    line = one_error_line(minillm("monitor", "--demo", "--record", str(tmp_path)))
    assert line == f"minillm: error: --record {tmp_path} is a directory: give a file to write the recording to"


def test_recording_over_the_replayed_file_is_refused_and_leaves_it_whole(tmp_path):
    path = demo_copy(tmp_path)
    before = path.read_bytes()
    line = one_error_line(minillm("monitor", "--replay", str(path), "--record", str(tmp_path / "." / path.name)))
    assert line == f"minillm: error: --record {tmp_path / '.' / path.name} is the --replay file: recording would overwrite it"
    assert path.read_bytes() == before


# ---- serve's limits --------------------------------------------------------------------------------

@pytest.mark.parametrize("option, value, shown", [
    ("--timeout-keep-alive", "inf", "inf"),
    ("--timeout-keep-alive", "nan", "nan"),
    ("--timeout-keep-alive", "-1", "-1.0"),
    ("--stream-timeout", "inf", "inf"),
    ("--header-timeout", "1e999", "inf"),
    ("--body-timeout", "0", "0.0"),
    ("--max-n", "0", "0"),
    ("--max-prompts-per-request", "-1", "-1"),
    ("--max-stop-string-length", "-3", "-3"),
])
def test_serve_refuses_limits_that_are_no_limit_naming_the_option(tmp_path, option, value, shown):
    # The limits are checked before the model is looked for: one that slipped through would end on
    # the missing model directory instead of serving.
    result = minillm("serve", str(tmp_path / "no-model"), "--device", "cpu", option, value)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result
    assert result.stderr.strip() == (f"minillm serve: error: Invalid value for '{option}': must be a finite number "
                                     f"> 0, got {shown} (try 'minillm serve --help')")


@needs_stories
@pytest.mark.parametrize("value, shown", [("inf", "inf"), ("nan", "nan"), ("0", "0.0"), ("-1", "-1.0")])
def test_serve_refuses_a_kv_lease_that_is_no_limit_naming_the_option(value, shown):
    # Checked before the model loads (a lease that slipped through would start serving).
    result = minillm("serve", str(STORIES), "--device", "cpu", "--kv-role", "producer", "--kv-lease-s", value)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result
    assert result.stderr.strip() == ("minillm serve: error: Invalid value for '--kv-lease-s': must be a finite "
                                     f"number > 0, got {shown} (try 'minillm serve --help')")


def test_server_limits_must_be_finite_and_positive():
    from minillm.server.limits import ServerLimits
    for bad in (float("inf"), float("nan"), 0.0, -5.0, "5", True):
        with pytest.raises(ValueError, match=r"^timeout_keep_alive_s must be a finite number > 0, got "):
            ServerLimits(timeout_keep_alive_s=bad)
    assert ServerLimits(timeout_keep_alive_s=0.5, max_n=1).timeout_keep_alive_s == 0.5


# ---- stdout ----------------------------------------------------------------------------------------

def minillm_stdout_closed(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI with file descriptor 1 closed, as `minillm ... >&-` in a shell does."""
    return subprocess.run([sys.executable, "-m", "minillm.cli", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))


@needs_stories
def test_generate_with_stdout_closed_fails_before_loading_and_says_why():
    result = minillm_stdout_closed("generate", str(STORIES), "--device", "cpu", "-p", "Once")
    assert one_error_line(result) == ("minillm: error: generate writes to stdout, which is closed; redirect it "
                                      "to a file (or to /dev/null to discard it)")


@needs_stories
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_generate_into_a_full_device_names_stdout():
    with open("/dev/full", "w") as full:
        result = subprocess.run([sys.executable, "-m", "minillm.cli", "generate", str(STORIES), "--device", "cpu",
                                 "-p", "Once"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "minillm: error: cannot write to stdout: No space left on device"


@needs_stories
def test_generate_into_a_pipe_whose_reader_left_stays_quiet():
    """`minillm generate ... | head -1`: the reader is gone before the first line; no error line, no traceback."""
    reader, writer = os.pipe()
    os.close(reader)       # the model takes a while to load: every write comes after this
    try:
        result = subprocess.run([sys.executable, "-m", "minillm.cli", "generate", str(STORIES), "--device", "cpu",
                                 "-p", "Once", "-p", "Lily"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=writer, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(writer)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "error" not in result.stderr
    assert "generate: 100%" in result.stderr            # it ran to the end before writing


@needs_stories
@pytest.mark.parametrize("args, command", [
    (("--version",), "--version"),
    (("list",), "list"),
    (("chat", str(STORIES), "--device", "cpu"), "chat"),
    (("bench", "serving", "--base-url", "http://127.0.0.1:9"), "bench serving"),
])
def test_commands_whose_output_is_the_point_refuse_a_closed_stdout(args, command):
    result = minillm_stdout_closed(*args)
    assert one_error_line(result) == (f"minillm: error: {command} writes to stdout, which is closed; redirect it "
                                      "to a file (or to /dev/null to discard it)")


# ---- bench serving --prompts-file ------------------------------------------------------------------

@pytest.mark.parametrize("make, why", [
    (lambda d: d, "--prompts-file: cannot read {p}: Is a directory"),
    (lambda d: d / "none.txt", "--prompts-file: cannot read {p}: No such file or directory"),
    (lambda d: (d / "latin1.txt", (d / "latin1.txt").write_bytes(b"caf\xe9\n"))[0],
     "--prompts-file {p} is not UTF-8 text: invalid continuation byte at byte 3"),
    (lambda d: (d / "blank.txt", (d / "blank.txt").write_text("\n  \n"))[0], "--prompts-file {p} holds no prompts"),
])
def test_bench_serving_prompts_file_is_read_before_connecting_and_named(tmp_path, make, why):
    path = make(tmp_path)
    # Port 9 has no server: a file not read first would end on "no server answers" instead.
    result = minillm("bench", "serving", "--base-url", "http://127.0.0.1:9", "--prompts-file", str(path))
    assert one_error_line(result) == f"minillm bench serving: error: {why.format(p=path)}"


# ---- --chat-template, --download-dir ----------------------------------------------------------------

@pytest.mark.parametrize("command", ["chat", "serve"])
def test_a_chat_template_directory_is_named_as_one(tmp_path, command):
    # Read before the model is looked for: the missing model directory is never reached.
    result = minillm(command, str(tmp_path / "no-model"), "--chat-template", str(tmp_path))
    assert one_error_line(result) == (f"minillm: error: --chat-template {tmp_path} is a directory; give the "
                                      "template's file, or the template itself")


def minillm_unprivileged(*args: str) -> subprocess.CompletedProcess:
    """Run the CLI where file modes hold: as it is for a user; for root, under setpriv without the
    capabilities that let root read and write any file (skipped where there is no setpriv)."""
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root reads a file whatever its mode, and there is no setpriv to drop that")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]
    return subprocess.run([*prefix, sys.executable, "-m", "minillm.cli", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)


def test_unreadable_and_unwritable_option_files_are_one_line_naming_the_option(tmp_path):
    locked = tmp_path / "locked"
    locked.write_text("{{ messages }}\n")
    locked.chmod(0)
    for command in ("chat", "serve"):
        # serve's reader took an unreadable file for no file ("looks like a file path, but there is no such file")
        result = minillm_unprivileged(command, str(tmp_path / "no-model"), "--chat-template", str(locked))
        assert one_error_line(result) == f"minillm: error: --chat-template: cannot read {locked}: Permission denied"
    result = minillm_unprivileged("bench", "serving", "--base-url", "http://127.0.0.1:9", "--prompts-file", str(locked))
    assert one_error_line(result) == f"minillm bench serving: error: --prompts-file: cannot read {locked}: Permission denied"
    result = minillm_unprivileged("monitor", "--demo", "--record", str(locked))
    assert one_error_line(result) == f"minillm: error: --record: cannot write {locked}: Permission denied"


@pytest.mark.parametrize("args", [
    ("generate", str(STORIES), "-p", "Once"), ("chat",), ("serve",), ("pull", "someorg/somemodel"), ("list",),
])
def test_a_download_dir_that_is_a_file_or_under_one_is_one_line_naming_the_option(tmp_path, args):
    a_file = tmp_path / "store"
    a_file.write_text("x")
    env = {"HF_HUB_OFFLINE": "1", "MINILLM_MODEL": ""}      # nothing may be fetched if the check slipped
    result = minillm(*args, "--download-dir", str(a_file), env=env)
    assert one_error_line(result) == f"minillm: error: --download-dir {a_file} is not a directory"
    under = a_file / "hub"
    result = minillm(*args, "--download-dir", str(under), env=env)
    assert one_error_line(result) == f"minillm: error: --download-dir {under} is not a directory ({a_file} is a file)"


# ---- bench pd_disagg's output paths ----------------------------------------------------------------

def test_bench_pd_disagg_output_paths_are_checked_before_any_server_starts(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (("--result-file", str(tmp_path)), f"--result-file {tmp_path} is a directory; give a file name"),
        (("--result-file", str(tmp_path / "no" / "r.json")), f"--result-file {tmp_path / 'no' / 'r.json'}: no such "
                                                              f"directory {tmp_path / 'no'}"),
        (("--log-dir", str(a_file)), f"--log-dir {a_file} is a file, not a directory"),
        (("--log-dir", str(a_file / "logs")), f"--log-dir {a_file / 'logs'}: cannot create it: Not a directory"),
    ]
    for args, why in cases:
        result = minillm("bench", "pd_disagg", "--device", "cpu", "--small", *args)
        assert one_error_line(result) == f"minillm bench pd_disagg: error: {why}"
