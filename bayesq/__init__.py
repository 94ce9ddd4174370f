"""BayesQ: uncertainty-guided post-training quantisation (pure library: tensors in, tensors out)."""

from bayesq.config import BayesQConfig, PosteriorConfig, QuantConfig
from bayesq.quantize import QuantizationResult, quantize_model

__all__ = ["BayesQConfig", "PosteriorConfig", "QuantConfig", "QuantizationResult", "quantize_model"]
