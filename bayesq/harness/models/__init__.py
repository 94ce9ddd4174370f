"""Embedded models: the zoo registry (see :mod:`bayesq.harness.models.zoo`)."""

from bayesq.harness.models.zoo import MODEL_NAMES, Splits, ZooEntry, evaluate, get_entry, logits, register

__all__ = ["MODEL_NAMES", "Splits", "ZooEntry", "evaluate", "get_entry", "logits", "register"]
