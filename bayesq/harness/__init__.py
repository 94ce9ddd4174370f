"""The benchmark harness, apart from the method: the embedded models and their recipes
(:mod:`bayesq.harness.models`), the data loaders and calibration draws
(:mod:`bayesq.harness.data`) and the image / text corruptions of the robustness evaluation
(:mod:`bayesq.harness.corruptions`). The method core (``bayesq/*.py``, ``bayesq/baselines``,
``bayesq/curvature``, ``bayesq/kernels``) reads none of it but for one thing: loading an export
rebuilds its architecture by name from the model registry (:func:`bayesq.export.load`). The
pipeline (``flows/``) drives both."""
