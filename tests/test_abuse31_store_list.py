"""minillm list over a store that holds half-downloaded snapshots: what minillm cannot run is marked,
with the reason the loader would give."""
from __future__ import annotations

import shutil

from test_cli import STORIES, minillm, needs_stories


def snapshot(store, name: str, leave_out: tuple[str, ...] = ()):
    """stories260K as the snapshot of org/NAME in STORE (refs/main naming it), without LEAVE_OUT."""
    folder = store / f"models--org--{name}"
    shutil.copytree(STORIES, folder / "snapshots" / "abc", ignore=shutil.ignore_patterns(*leave_out))
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("abc")
    return folder / "snapshots" / "abc"


@needs_stories
def test_list_marks_a_snapshot_without_tokenizer_or_with_weights_linked_to_nothing(tmp_path):
    # Both were listed as runnable, and `minillm generate org/...` then failed ("has no tokenizer.json",
    # "no such file"): the list is where a user looks to see what a download left behind.
    store = tmp_path / "store"
    snapshot(store, "good")
    snapshot(store, "notok", leave_out=("tokenizer.json",))
    unlinked = snapshot(store, "unlinked", leave_out=("model.safetensors",))
    (unlinked / "model.safetensors").symlink_to("../../blobs/gone")      # its blob deleted from the cache
    result = minillm("list", "--download-dir", str(store))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert set(rows) == {"org/good", "org/notok", "org/unlinked"}
    assert "cannot run" not in rows["org/good"]
    assert rows["org/notok"].endswith("(minillm cannot run it: no tokenizer.json)")
    assert rows["org/unlinked"].endswith("(minillm cannot run it: incomplete download)")
