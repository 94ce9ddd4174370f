"""Curvature estimators (diagonal Fisher for now; Hutchinson, K-FAC and low-rank follow)."""
