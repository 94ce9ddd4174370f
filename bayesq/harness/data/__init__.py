"""Raw data loaders: Fashion-MNIST IDX files, vader sentiment sentences, calibration sampling."""

from bayesq.harness.data.calibration import sample_calibration_indices
from bayesq.harness.data.fashion_mnist import load_fashion_mnist
from bayesq.harness.data.sentiment import binary_labels, load_vader_domain, split_indices

__all__ = [
    "binary_labels",
    "load_fashion_mnist",
    "load_vader_domain",
    "sample_calibration_indices",
    "split_indices",
]
