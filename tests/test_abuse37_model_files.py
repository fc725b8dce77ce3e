"""Broken and unusual model directories (copies of stories260K in a tmp dir), read as vLLM reads them."""
from __future__ import annotations

import json

import pytest

from minillm.loader import load_model_config, load_weights


def stories_copy(stories_path, out, **config_changes):
    """out with stories260K's files linked in, its config.json written with config_changes."""
    out.mkdir()
    for f in stories_path.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((stories_path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **config_changes}))
    return out


def test_a_rope_type_and_a_legacy_type_that_disagree_are_refused(stories_path, tmp_path):
    """vLLM's patch_legacy_rope_type: 'Found conflicts between rope_type ... and type ...'; minillm ran
    the rope_type and dropped the type."""
    folder = stories_copy(stories_path, tmp_path / "m", rope_scaling={"rope_type": "linear", "type": "dynamic",
                                                                      "factor": 2.0})
    with pytest.raises(ValueError, match="conflicting rope_type 'linear' .* and type 'dynamic'"):
        load_model_config(folder)


def test_legacy_rope_types_su_and_mrope_are_read_as_vllm_reads_them(stories_path, tmp_path):
    """'su' is longrope and 'mrope' with its mrope_section the default rotary (vLLM replaces both names
    with a warning); both were 'rope_scaling type ... is not supported'."""
    factors = {"short_factor": [1.0, 1.5, 2.0, 1.0], "long_factor": [2.0, 2.0, 3.0, 4.0]}
    su = load_model_config(stories_copy(stories_path, tmp_path / "su", rope_scaling={"type": "su", **factors}))
    longrope = load_model_config(stories_copy(stories_path, tmp_path / "longrope",
                                              rope_scaling={"rope_type": "longrope", **factors}))
    assert su == longrope and su.rope_scaling["rope_type"] == "longrope"
    mrope = load_model_config(stories_copy(stories_path, tmp_path / "mrope",
                                           rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}))
    assert mrope == load_model_config(stories_path)
    with pytest.raises(ValueError, match="'mrope' needs an 'mrope_section'"):
        load_model_config(stories_copy(stories_path, tmp_path / "bare", rope_scaling={"type": "mrope"}))


@pytest.mark.parametrize("layers", [6, 10**6])
def test_a_config_naming_more_layers_than_the_checkpoint_holds_says_so_at_once(stories_path, tmp_path, layers):
    """The error names num_hidden_layers and the checkpoint's last layer, before a name is listed for each
    layer config.json names (10**9 layers listed names for minutes; 10**6 took seconds)."""
    folder = stories_copy(stories_path, tmp_path / "m", num_hidden_layers=layers)
    with pytest.raises(ValueError, match=rf"missing tensor model\.layers\.5\.input_layernorm\.weight "
                                         rf"\(config\.json's num_hidden_layers {layers}, the checkpoint has layers "
                                         rf"up to 4\)"):
        load_weights(folder, load_model_config(folder), "float32")


def test_a_tensor_of_the_wrong_shape_is_named_with_its_file(stories_path, tmp_path):
    """In a sharded checkpoint the error says which shard holds the bad tensor."""
    from safetensors.numpy import load_file, save_file
    folder = stories_copy(stories_path, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    tensors = load_file(str(stories_path / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1]
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:10]}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[10:]}, str(folder / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match=r"tensor model\.norm\.weight in model-00002-of-00002\.safetensors has "
                                         r"shape \[63\], expected \[64\] from config\.json"):
        load_weights(folder, load_model_config(folder), "float32")
