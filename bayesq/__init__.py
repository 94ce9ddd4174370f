"""BayesQ: uncertainty-guided post-training quantisation (pure library: tensors in, tensors out)."""

from bayesq.baselines import aciq, awq, gptq, hawq, rtn  # noqa: F401  (each registers its method)
from bayesq.config import BayesQConfig, PosteriorConfig, QuantConfig
from bayesq.methods import Inputs, Outcome, quantize_with
from bayesq.quantize import QuantizationResult, quantize_model

__all__ = ["BayesQConfig", "Inputs", "Outcome", "PosteriorConfig", "QuantConfig", "QuantizationResult",
           "quantize_model", "quantize_with"]
