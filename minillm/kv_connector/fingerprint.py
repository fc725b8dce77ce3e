"""A fingerprint of the weights an engine serves, so a decode engine refuses KV computed by another model.

Blocks of the same shape (layers, KV heads, head size, block size, dtype) can come from different
models: a base model and its instruct tune, two fine-tunes. Their KV is no use to each other, and
copied over it decodes garbage without an error. The fingerprint hashes each tensor's name, dtype
and shape and the first and last bytes of its data (a fine-tune changes them all), read with a few
small reads per tensor, so the same weights give the same fingerprint wherever they are stored.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

SAMPLE_BYTES = 256        # read from each end of each tensor's data


def weights_fingerprint(path: str | Path) -> str:
    """32 hex digits for the safetensors weights of a model directory."""
    from minillm.loader import checkpoint_tensors
    digest = hashlib.sha256()
    handles = {}
    try:
        for name, entry in sorted(checkpoint_tensors(path).items()):
            digest.update(f"{name}|{entry.dtype}|{list(entry.shape)}|".encode())
            f = handles.get(entry.file)
            if f is None:
                f = handles[entry.file] = open(entry.file, "rb")
            for start in sorted({entry.start, max(entry.start, entry.end - SAMPLE_BYTES)}):
                f.seek(start)
                digest.update(f.read(min(SAMPLE_BYTES, entry.end - start)))
    finally:
        for f in handles.values():
            f.close()
    return digest.hexdigest()[:32]


def model_fingerprint(config) -> str:
    """The fingerprint of what an EngineConfig serves: its weights', or its dummy weights' seed."""
    if config.load_format == "dummy":
        return f"dummy-{config.model}-{config.seed}"
    from minillm.model_store import resolve_model_path
    return weights_fingerprint(resolve_model_path(config.model, config.download_dir, config.revision))
