"""Display names shared by the report modules: each layer's family (each method's label is its
registry entry's, :data:`flows.methods.METHOD_LABEL`)."""

from __future__ import annotations

LAYER_KINDS = (  # (substring of the module name, kind) -- first match wins
    ("attention.self.query", "attention q/k/v"), ("attention.self.key", "attention q/k/v"),
    ("attention.self.value", "attention q/k/v"), ("attention.output", "attention out"),
    ("intermediate", "FFN in"), ("output.dense", "FFN out"), ("pooler", "pooler"),
    ("classifier", "classifier"), ("_conv_stem", "stem conv"), ("_expand_conv", "expand 1x1"),
    ("_depthwise_conv", "depthwise 3x3/5x5"), ("_project_conv", "project 1x1"),
    ("_conv_head", "head 1x1"), ("_fc", "classifier"), ("downsample", "downsample 1x1"),
    ("conv1", "3x3 conv"), ("conv2", "3x3 conv"), ("fc", "classifier"),
)


def layer_kind(name: str) -> str:
    """Coarse layer family of a module name (for the per-layer bit summary)."""
    for key, kind in LAYER_KINDS:
        if key in name:
            return kind
    return name.rsplit(".", 1)[-1]
