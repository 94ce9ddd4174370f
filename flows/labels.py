"""Display names and formats shared by the report modules and the stages: each layer's family, a
paired interval as text (each method's label is its registry entry's, :data:`flows.methods.METHOD_LABEL`)."""

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


def ci_text(row: dict, fmt: str) -> str:
    """``diff [low, high]`` in ``fmt``, with * when the interval excludes 0."""
    resolved = "*" if row["ci_low"] > 0 or row["ci_high"] < 0 else ""
    return f"{row['diff']:{fmt}} [{row['ci_low']:{fmt}}, {row['ci_high']:{fmt}}]{resolved}"
