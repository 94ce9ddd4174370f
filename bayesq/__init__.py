"""BayesQ: uncertainty-guided post-training quantisation (pure library: tensors in, tensors out)."""

import importlib
import pkgutil

from bayesq import baselines
from bayesq.config import BayesQConfig, PosteriorConfig, QuantConfig
from bayesq.methods import Inputs, Outcome, quantize_with
from bayesq.quantize import quantize_model
from bayesq.result import QuantizationResult

for _module in pkgutil.iter_modules(baselines.__path__):  # each method module registers its handler on import
    importlib.import_module(f"bayesq.baselines.{_module.name}")

__all__ = ["BayesQConfig", "Inputs", "Outcome", "PosteriorConfig", "QuantConfig", "QuantizationResult",
           "quantize_model", "quantize_with"]
