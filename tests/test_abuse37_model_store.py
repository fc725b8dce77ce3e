"""minillm list and the hub id lookup over a damaged store: interrupted pulls, refs that cannot be
read, repo folders that are no directory. Each is listed with why, as huggingface_hub's scan_cache_dir
reports them, and none ends the command."""
from __future__ import annotations

from conftest import put_in_hf_cache
from test_cli import STORIES, minillm, needs_stories

from minillm.model_store import resolve_model_path


def _damaged_store(store):
    """A store with one runnable model and one of each kind of damage."""
    put_in_hf_cache(store, "org/good", STORIES)
    put_in_hf_cache(store, "org/binref", STORIES)
    (store / "models--org--binref" / "refs" / "main").write_bytes(b"\xff\xfe")
    (store / "models--org--gone").symlink_to(store / "nowhere")
    started = store / "models--org--started"          # stopped before its first file was done
    (started / "blobs").mkdir(parents=True)
    (started / "refs").mkdir()
    (started / "refs" / "main").write_text("0123abcd")
    (started / "blobs" / "f00d.incomplete").write_bytes(b"\0" * 10)
    half = put_in_hf_cache(store, "org/half", STORIES)   # the weights still coming
    (half / "model.safetensors").unlink()
    (store / "models--org--half" / "blobs" / "beef.incomplete").write_bytes(b"\0" * 10)
    cut = put_in_hf_cache(store, "org/cut", STORIES)     # config.json's blob deleted
    (cut / "config.json").resolve().unlink()
    notok = put_in_hf_cache(store, "org/notok", STORIES)   # the weights done, the tokenizer still coming
    (notok / "tokenizer.json").unlink()
    (store / "models--org--notok" / "blobs" / "cafe.incomplete").write_bytes(b"\0" * 10)


@needs_stories
def test_list_shows_each_damaged_repo_with_why_and_a_bad_ref_does_not_end_it(tmp_path):
    # A non-UTF-8 refs/main ended list (and generate) with "'utf-8' codec can't decode byte 0xff"; a pull
    # stopped before its first file, and a repo folder that is a dangling link, were left out of the list;
    # weights still in blobs/*.incomplete read "no safetensors weights", a deleted config blob "no config.json",
    # a tokenizer still coming "no tokenizer.json".
    store = tmp_path / "store"
    _damaged_store(store)
    result = minillm("list", "--download-dir", str(store))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert sorted(rows) == ["org/binref", "org/cut", "org/gone", "org/good", "org/half", "org/notok",
                            "org/started"]
    assert "cannot run" not in rows["org/good"] and "cannot run" not in rows["org/binref"]
    assert rows["org/started"].endswith("(minillm cannot run it: incomplete download (no snapshot))")
    assert rows["org/gone"].endswith(f"damaged: it is a symbolic link to {store / 'nowhere'}, which does not exist)")
    assert rows["org/half"].endswith("(minillm cannot run it: incomplete download)")
    assert rows["org/notok"].endswith("(minillm cannot run it: incomplete download (no tokenizer.json))")
    assert rows["org/cut"].endswith("(minillm cannot run it: incomplete download (no config.json))")
    snapshot = store / "models--org--binref" / "snapshots" / "0123abcd"
    assert resolve_model_path("org/binref", str(store)) == snapshot


@needs_stories
def test_offline_pull_of_a_half_downloaded_snapshot_is_an_error_not_pulled(tmp_path):
    # With HF_HUB_OFFLINE=1, snapshot_download hands back the snapshot the store holds, whole or not: pull
    # said "pulled org/half into ..." with its weights still in blobs/*.incomplete.
    store = tmp_path / "store"
    _damaged_store(store)
    result = minillm("pull", "org/half", "--download-dir", str(store), env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr.strip().splitlines() == [
        f"minillm: error: org/half: HF_HUB_OFFLINE is set, so nothing is fetched, and its snapshot in the store "
        f"({store / 'models--org--half' / 'snapshots' / '0123abcd'}) cannot be run: incomplete download"]


def test_pull_of_an_id_the_hub_refuses_names_the_rule_it_breaks(tmp_path):
    # huggingface_hub refuses '--', '..' and a trailing .git in a repo id; offline, its HFValidationError
    # read "HF_HUB_OFFLINE is set, so nothing is fetched, and the store holds no snapshot of it".
    for model in ("org/a--b", "org/name.git"):
        result = minillm("pull", model, "--download-dir", str(tmp_path), env={"HF_HUB_OFFLINE": "1"})
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"minillm: error: no such directory: {model} (and it is not a Hugging Face repo id: those have no "
            f"'--' or '..' and do not end in .git); pull takes a Hugging Face repo id such as Qwen/Qwen3-0.6B"]
