"""A user's keras.distribution layout maps for the reference MLP, imported by the scripts
under test through `--layout_map=user_layouts:<function>` (tests put this folder on
PYTHONPATH, as a user's project would be)."""

import keras


def mlp_layout_map(device_mesh):
    """Megatron's column/row pairs over the reference MLP's blocks."""
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map["mlp_hidden_[02]/.*kernel"] = (None, "model")
    layout_map["mlp_hidden_[02]/.*bias"] = ("model",)
    layout_map["mlp_hidden_1/.*kernel"] = ("model", None)
    layout_map["mlp_head/.*kernel"] = ("model", None)
    return layout_map


def not_a_layout_map(device_mesh):
    """A mistake: a plain dict instead of a LayoutMap."""
    return {"mlp_head/.*kernel": ("model", None)}
