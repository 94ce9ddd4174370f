"""Embedded models: the zoo registry (see :mod:`bayesq.models.zoo`)."""

from bayesq.models.zoo import MODEL_NAMES, Splits, ZooEntry, evaluate, get_entry, logits, register

__all__ = ["MODEL_NAMES", "Splits", "ZooEntry", "evaluate", "get_entry", "logits", "register"]
