"""Display names shared by the report modules: each method's label and each layer's family."""

from __future__ import annotations

METHOD_LABEL = {"bayesq": "BayesQ", "bayesq-distill": "BayesQ + distillation", "bayesq-ef": "BayesQ (K-FAC)",
                "bayesq-paper": "BayesQ (paper-literal)", "bayesq-brecq": "BayesQ + BRECQ rounding (no bias correction)",
                "gptq": "GPTQ (best variant, act-order)",
                "awq": "AWQ (g64)", "hawq": "HAWQ-style (per layer)", "aciq": "ACIQ (per channel)",
                "zeroq": "ZeroQ (per layer, distilled data)",
                "rtn-tensor": "RTN per-tensor", "rtn-channel": "RTN per-channel", "rtn-group": "RTN per-group (g64)",
                "adaround": "AdaRound (best variant)", "brecq": "BRECQ (best variant)",
                "lsq": "LSQ (best variant)", "lsq-plus": "LSQ+ (best variant)",
                "pact": "PACT (best variant)", "dorefa": "DoReFa (best variant)",
                "bit-split": "Bit-Split (best variant)", "ocs": "OCS + GPTQ (best ratio and variant)",
                "optq": "OPTQ (best variant, natural order)", "clip-block": "Per-block uniform + clipping (g64)",
                "lloyd-block": "Per-block Lloyd (LUT per 1024)", "smoothquant": "SmoothQuant weight-only (best variant)",
                "anneal": "Mixed precision by annealing (per layer, GPTQ)"}


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
