"""Baselines sharing BayesQ's blocks, storage accounting and allocation interface."""
