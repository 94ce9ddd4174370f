"""Per (model, seed) preparation shared by the quantize and ablate stages: the calibration
inputs, the posterior, the BayesQ loss tables, HAWQ's Hessian traces.

The model's ``exclude`` patterns (``params.yaml``, :meth:`flows.params.Params.excluded`) are an
input of the tasks that choose layers (posterior, statistics, traces), so they key their
caches; the tables and the rows read the layers of the saved posterior.

These tasks are keyed on :func:`prep_code` — every source under ``bayesq/`` and ``flows/`` but
the export format, the kernels and the downstream flows — so work on those does not refit a
posterior or rebuild a table (the posteriors and tables of the embedded models take ~30 min).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import task

from bayesq.baselines.activations import InputStats, input_stats
from bayesq.baselines.hawq import hessian_traces
from bayesq.blocks import excluded, layer_blocks
from bayesq.canonical import canonical
from bayesq.config import BayesQConfig, Curvature
from bayesq.curvature.kfac import KFACFactors
from bayesq.evaluation import predict, reference_log_probs
from bayesq.forward import batch_size, by_length
from bayesq.harness.data.calibration import sample_calibration_indices, sample_selection_indices
from bayesq.harness.data.sentiment import seeded_permutation
from bayesq.harness.models.zoo import _take, get_entry
from bayesq.posterior import CURVATURES, DiagonalCurvature, Posterior, WeightMeans, fit_diagonal_posterior
from bayesq.quantize import fit_posterior
from bayesq.rounding import ef_column_metric
from bayesq.selection import first_look_inputs
from bayesq.settings import replace
from bayesq.tables import build_table, grid_tables
from bayesq.tensorfile import file_sha256, save_tensors
from flows.common import CACHE, code_version, digest
from flows.configs import method_settings
from flows.finetune import load_model
from flows.methods import SHARED_PREP, Method
from flows.params import CalibrationConfig, SelectionInputs
from flows.timings import plain_call

# curvatures whose posterior is the saved curvature diagonal under a prior (reprior_task can refit it)
DIAGONAL = tuple(c for c, backend in CURVATURES.items() if isinstance(backend, DiagonalCurvature))

# sources the preparation tasks do not run (a new file elsewhere is included by default)
PREP_EXCLUDE = ("bayesq/export.py", "bayesq/qlayers.py", "bayesq/kernels", "flows/quantize.py", "flows/ablate.py",
                "flows/shift.py",
                "flows/report", "flows/robustness_report.py", "flows/labels.py", "flows/cli.py", "flows/zoo.py",
                "flows/settings.py", "flows/__main__.py", "flows/lineage.py", "flows/locks.py",
                "bayesq/baselines/gptq.py", "bayesq/baselines/awq.py", "bayesq/baselines/aciq.py", "bayesq/distill.py")


def prep_code() -> str:
    """Code version of the preparation tasks (and the FP evaluation)."""
    return code_version(exclude=PREP_EXCLUDE)


def checked_exclude(name: str, model, patterns) -> tuple[str, ...]:
    """``patterns`` (``exclude.<name>`` of params.yaml) as a tuple, after checking that each
    matches the name of a module of ``model`` (as written, or as :mod:`bayesq.canonical` rewrites
    it: ``attn.q_proj``), so a typo cannot silently keep nothing in floating point.

    Raises:
        ValueError: naming the model, the pattern and some of the modules' names.
    """
    with canonical(model):
        rewritten = {n for n, _ in model.named_modules() if n}
    names = sorted(rewritten | {n for n, _ in model.named_modules() if n})
    shown = names if len(names) <= 4 else [*names[:3], "...", names[-1]]
    for p in patterns:
        if not any(excluded(n, (p,)) for n in names):
            raise ValueError(f"exclude.{name}: pattern {p!r} matches no module of {name} (modules: "
                             f"{', '.join(shown)}); a pattern matches whole module names and everything inside "
                             "them (fnmatch: 'encoder.layer.0' or 'encoder.layer.*.attention'): fix or delete it")
    return tuple(patterns)


def _sizes(entry, calibration, n_total: int) -> tuple[int, int]:
    """(calibration inputs, selection inputs) of the entry's kind (images or sentences), the
    calibration size capped at the pool of ``n_total`` training inputs."""
    image = entry.task == "image"
    n_cal = calibration.images if image else calibration.sentences
    return min(n_cal, n_total), calibration.selection_images if image else calibration.selection_sentences


def fit_inputs(calibration):
    """``calibration`` as the fitting tasks (posterior, tables, statistics, traces) see it: the
    settings of the selection draw, which they never read, at their defaults, so a run that only
    changes how choices are scored reuses their cached results."""

    d = CalibrationConfig()
    return replace(calibration, selection=d.selection, selection_images=d.selection_images,
                   selection_sentences=d.selection_sentences)


def calibration_indices(entry, splits, calibration, seed: int):
    """(n_cal,) int64 indices into the training split of the seed's calibration inputs."""

    n_total = len(splits.train_labels)
    return sample_calibration_indices(n_total, _sizes(entry, calibration, n_total)[0], seed)


def calibration_batches(entry, splits, data, calibration, seed: int):
    """Unlabelled calibration batches drawn from the training inputs with ``seed``: (indices
    (sorted), batches). Tokenised sentences are regrouped by length
    (:func:`bayesq.forward.by_length`: a random draw in batches of 32 is about half padding, which
    every pass would compute), the batches then in a seeded random order (K-FAC's running
    average and the distillation read them in order). Images keep the order of ``indices``."""

    idx = calibration_indices(entry, splits, calibration, seed)
    inputs = _take(splits.train_inputs, idx)
    batches = entry.batches(inputs, calibration.batch_size, data)
    if entry.lengths(inputs) is None:
        return idx, batches
    grouped = by_length(batches)
    return idx, [grouped[i] for i in seeded_permutation(len(grouped), seed).tolist()]


def selection_batches(entry, splits, data, calibration, seed: int):
    """The batches that score selections among candidates fitted on the calibration inputs
    (BayesQ's grids, GPTQ's / AWQ's variants): with ``calibration.selection: held-out`` a second
    draw of ``calibration.selection_images`` / ``selection_sentences`` training inputs, disjoint
    from the calibration draw (:func:`bayesq.harness.data.calibration.sample_selection_indices`; fewer
    when the pool runs out); None scores on the calibration inputs themselves."""

    if SelectionInputs(calibration.selection) != SelectionInputs.HELD_OUT:
        return None
    n_total = len(splits.train_labels)
    n_cal, n_sel = _sizes(entry, calibration, n_total)
    inputs = _take(splits.train_inputs, sample_selection_indices(n_total, n_cal, seed, n_sel))
    batches = list(entry.batches(inputs, calibration.batch_size, data))
    # the first look (bayesq.selection.selection_looks) is the draw's first inputs, a random sample;
    # inside each look the sentences are regrouped by length (scored input by input, the order is free)
    first = -(-first_look_inputs(len(inputs), calibration.batch_size) // calibration.batch_size)
    return by_length(batches[:first]) + by_length(batches[first:])


@task(cache_policy=CACHE, persist_result=True, task_run_name="posterior {name} s{seed} {tag}")
def posterior_task(name: str, model_file: str, model_digest: str, raw: str, raw_digest: str,
                   data, calibration, posterior, seed: int, out: str, code: str, tag: str = "",
                   exclude: tuple[str, ...] = ()) -> dict:
    """Fit the posterior on the seed's calibration set, of the layers ``exclude`` (module names
    or glob patterns) does not match; save it as safetensors.

    The file holds the variances, the error-feedback metrics of structured posteriors and the
    calibration indices (which inputs were used); it is written byte-deterministically, so
    ``sha256`` (returned) identifies the posterior across runs.
    """

    entry = get_entry(name)
    model = load_model(entry, Path(model_file))
    splits = entry.load_splits(data, Path(raw))
    idx, batches = calibration_batches(entry, splits, data, calibration, seed)
    start = time.perf_counter()
    post = fit_posterior(model, batches, BayesQConfig(posterior=posterior, seed=seed), exclude=exclude)
    seconds = time.perf_counter() - start
    return _saved_posterior(post, idx, posterior, seed, Path(out) / f"{name}_s{seed}{'_' + tag if tag else ''}.safetensors",
                            seconds)


@task(cache_policy=CACHE, persist_result=True, task_run_name="posterior {name} s{seed} {tag}")
def reprior_task(name: str, model_file: str, model_digest: str, base_file: str, base_sha256: str, posterior,
                 seed: int, out: str, code: str, tag: str) -> dict:
    """:func:`posterior_task`'s record for a diagonal posterior that differs from the one saved at
    ``base_file`` (keyed by ``base_sha256``) only in its prior (``posterior.prior`` / ``damping``):
    the base's curvature under the new prior (:func:`bayesq.posterior.fit_diagonal_posterior`),
    no calibration pass (``seconds`` counts only the refit)."""
    from safetensors import safe_open


    model = load_model(get_entry(name), Path(model_file))
    start = time.perf_counter()
    with safe_open(base_file, "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
        layers = posterior_layers(model, keys)  # the base's (its exclusion)
        if meta["curvature"] != posterior.curvature.value or any(k.startswith("kfac_A/") for k in keys):
            raise ValueError(f"{base_file} holds a '{meta['curvature']}' posterior; re-fitting its prior needs a "
                             f"diagonal '{posterior.curvature.value}' one: use posterior_task")
        n = int(meta["n_examples"])
        scale = posterior.n_data / n if posterior.n_data else 1.0  # the saved curvature is scaled by it
        curvature = {k: f.get_tensor(f"curvature/{k}").double() / scale for k in layers}
        idx = f.get_tensor("calibration_indices")
    post = fit_diagonal_posterior(curvature, n, {k: m.weight for k, m in layers.items()}, posterior,
                                  indefinite=posterior.curvature.value.startswith("hutchinson"))
    seconds = time.perf_counter() - start
    return _saved_posterior(post, idx, posterior, seed, Path(out) / f"{name}_s{seed}_{tag}.safetensors", seconds)


def _saved_posterior(post, idx, posterior, seed: int, path: Path, seconds: float) -> dict:
    """Write ``post`` (and the calibration indices ``idx``) byte-deterministically to ``path``;
    the record :func:`posterior_task` returns."""
    import torch


    tensors = {f"variance/{k}": v.float().contiguous() for k, v in post.variance.items()}
    tensors.update({f"curvature/{k}": v.float().contiguous() for k, v in post.curvature.items()})
    tensors.update({f"prior_precision/{k}": torch.tensor([v], dtype=torch.float64)
                    for k, v in post.prior_precision.items()})
    for k, f in (post.kfac or {}).items():  # damped K-FAC factors (float64: they get inverted)
        tensors[f"kfac_A/{k}"], tensors[f"kfac_G/{k}"] = f.A.contiguous(), f.G.contiguous()
        tensors[f"input_moment/{k}"] = post.input_moment[k].contiguous()
    tensors["calibration_indices"] = idx.to(torch.int64)
    save_tensors(path, tensors, {"n_examples": str(post.n_examples), "seed": str(seed), "n_data": str(post.n_data),
                                 "curvature": posterior.curvature.value, "prior": posterior.prior.value})
    return {"path": str(path), "seconds": seconds, "n_examples": post.n_examples, "sha256": file_sha256(path),
            "curvature": posterior.curvature.value, "prior": posterior.prior.value, **posterior_summary(post)}


def posterior_summary(post) -> dict:
    """What the report shows of a posterior: per-layer prior precision lambda_l and the
    prior-dominated share (posterior variance within 10 % of the prior's), per layer and pooled."""
    return {"prior_precision": dict(post.prior_precision),
            "prior_dominated": {k: post.prior_dominated_share(k) for k in post.mean},
            "prior_dominated_share": post.prior_dominated_share()}


def posterior_layers(model, keys) -> dict:
    """The layers of ``model`` a saved posterior holds (``keys``: its tensor names), in network
    order: those its ``exclude`` did not match."""
    return {n: m for n, m in model.named_modules() if f"variance/{n}" in keys}


def load_posterior(model, path: Path):
    """The :class:`bayesq.posterior.Posterior` saved by ``posterior_task`` (means from ``model``;
    the layers the file holds)."""
    from safetensors import safe_open


    with safe_open(str(path), "pt") as f:
        layers = posterior_layers(model, set(f.keys()))
        var = {n: f.get_tensor(f"variance/{n}").double() for n in layers}
        curv = {n: f.get_tensor(f"curvature/{n}").double() for n in layers}
        prior = {n: float(f.get_tensor(f"prior_precision/{n}")[0]) for n in layers}
        keys = set(f.keys())
        meta = f.metadata()
        n = int(meta["n_examples"])
        kfac = {k: KFACFactors(f.get_tensor(f"kfac_A/{k}"), f.get_tensor(f"kfac_G/{k}"), n)
                for k in layers if f"kfac_A/{k}" in keys}
        moment = {k: f.get_tensor(f"input_moment/{k}") for k in kfac}
    mean = WeightMeans({k: m.weight for k, m in layers.items()})
    return Posterior(mean, var, n, kfac or None, int(meta.get("n_data", 0)), curv, prior, moment or None)


@task(cache_policy=CACHE, persist_result=True, task_run_name="layer-input statistics {name} s{seed}")
def stats_task(name: str, model_file: str, model_digest: str, raw: str, raw_digest: str,
               data, calibration, seed: int, out: str, code: str, exclude: tuple[str, ...] = ()) -> dict:
    """Layer-input statistics of every quantisable layer ``exclude`` does not match on the seed's
    calibration inputs (:func:`bayesq.baselines.activations.input_stats`), saved as safetensors
    ``<out>/<model>_s<seed>.safetensors``: one pass read by every row that needs them (GPTQ and
    AWQ; BayesQ's error-feedback metric and bias correction), instead of one pass per row.
    Returns ``{"path", "sha256", "seconds"}``."""
    import torch

    entry = get_entry(name)
    model = load_model(entry, Path(model_file))
    _, batches = calibration_batches(entry, entry.load_splits(data, Path(raw)), data, calibration, seed)
    start = time.perf_counter()
    stats = input_stats(model, batches, exclude=tuple(exclude))
    seconds = time.perf_counter() - start
    tensors = {}
    for k, st in stats.items():
        tensors |= {f"H/{k}": st.H.contiguous(), f"abs_mean/{k}": st.abs_mean.contiguous(),
                    f"abs_max/{k}": st.abs_max.contiguous(), f"mean/{k}": st.mean.contiguous(),
                    f"positions/{k}": torch.tensor([st.positions], dtype=torch.float64)}
    n = {st.n for st in stats.values()}
    path = save_tensors(Path(out) / f"{name}_s{seed}.safetensors", tensors, {"n": str(n.pop()), "seed": str(seed)})
    return {"path": str(path), "sha256": file_sha256(path), "seconds": seconds}


CALIBRATION_PART = "calibration."  # key prefix of the calibration logits in a reference file


@task(cache_policy=CACHE, persist_result=True, task_run_name="FP on the selection draw {name} s{seed}")
def reference_task(name: str, model_file: str, model_digest: str, raw: str, raw_digest: str,
                   data, calibration, seed: int, out: str, code: str) -> dict:
    """The FP model's log-probabilities on the seed's selection draw (:func:`selection_batches`,
    :func:`bayesq.evaluation.reference_log_probs`) and its logits on the calibration draw
    (:func:`calibration_batches`, :func:`bayesq.evaluation.predict`), saved as safetensors
    ``<out>/<model>_s<seed>.safetensors`` (one float64 (rows, C) tensor per selection batch, one
    float32 one per calibration batch): forward passes read by every row that scores a selection
    on the draw (BayesQ's grids, GPTQ's and AWQ's variants) or fits the output offset instead of
    one per row (:func:`load_reference`). Returns ``{"path", "sha256", "seconds"}``, or ``{}``
    when selections are scored on the calibration inputs (``calibration.selection: calibration``)."""

    entry = get_entry(name)
    splits = entry.load_splits(data, Path(raw))
    batches = selection_batches(entry, splits, data, calibration, seed)
    if batches is None:
        return {}
    model = load_model(entry, Path(model_file))
    start = time.perf_counter()
    ref = reference_log_probs(model, batches)
    cal = list(calibration_batches(entry, splits, data, calibration, seed)[1])
    logits = predict(model, cal).split([batch_size(b) for b in cal])
    seconds = time.perf_counter() - start
    tensors = {f"{i:06d}": r.contiguous() for i, r in enumerate(ref)}
    tensors |= {f"{CALIBRATION_PART}{i:06d}": z.contiguous() for i, z in enumerate(logits)}
    path = save_tensors(Path(out) / f"{name}_s{seed}.safetensors", tensors, {"seed": str(seed)})
    return {"path": str(path), "sha256": file_sha256(path), "seconds": seconds}


def load_reference(path: Path, part: str = "selection") -> list:
    """What :func:`reference_task` saved, one tensor per batch in batch order: the FP
    log-probabilities on the selection draw (``part="selection"``) or its logits on the
    calibration draw (``part="calibration"``)."""
    from safetensors import safe_open

    if part not in ("selection", "calibration"):
        raise ValueError(f"part = {part!r}: a reference file holds the 'selection' and 'calibration' parts")
    with safe_open(str(path), "pt") as f:
        keys = [k for k in f.keys() if k.startswith(CALIBRATION_PART) == (part == "calibration")]
        return [f.get_tensor(k) for k in sorted(keys)]


def shared_cost(record: dict, stats: dict, reference: dict | None = None) -> dict:
    """``{"stats_seconds": ..., "reference_seconds": ...}`` for the shared passes the row
    ``record`` read: the statistics pass ``stats`` (:func:`stats_task`'s record) and the FP pass
    over the selection draw ``reference`` (:func:`reference_task`'s). Each counts in full in every
    row that read it."""
    out = {"stats_seconds": stats["seconds"]} if record["stats_read"] else {}
    if reference and record.get("reference_read"):
        out["reference_seconds"] = reference["seconds"]
    return out


def load_stats(path: Path) -> dict:
    """The layer name -> :class:`bayesq.baselines.activations.InputStats` saved by ``stats_task``."""
    from safetensors import safe_open


    with safe_open(str(path), "pt") as f:
        n = int(f.metadata()["n"])
        names = [k[2:] for k in f.keys() if k.startswith("H/")]
        return {k: InputStats(f.get_tensor(f"H/{k}"), f.get_tensor(f"abs_mean/{k}"), n, f.get_tensor(f"mean/{k}"),
                              float(f.get_tensor(f"positions/{k}")), f.get_tensor(f"abs_max/{k}"))
                for k in names}


@task(cache_policy=CACHE, persist_result=True, task_run_name="table {name} s{seed} {tag}")
def table_task(name: str, model_file: str, model_digest: str, posterior_file: str,
               posterior_digest: str, raw: str, raw_digest: str, data, calibration, quant,
               seed: int, out: str, code: str, tag: str = "", stats_file: str = "", stats_sha256: str = ""):
    """BayesQ expected-loss table (LossTable, persisted by Prefect) plus its Parquet copy
    ``<out>/<posterior file stem>[_<tag>].parquet`` (with every entry's standard error), and the
    tables of the other grid candidates (``"tables"``, :func:`bayesq.tables.grid_tables`:
    built once here instead of once per budget and row; ``seconds`` counts them).
    ``stats_file`` (:func:`stats_task`'s file, keyed by ``stats_sha256``): the error-feedback
    metric is read from it (the rows count that pass) instead of a statistics pass here."""
    import pandas as pd


    entry = get_entry(name)
    model = load_model(entry, Path(model_file))
    post = load_posterior(model, Path(posterior_file))
    layers = {k: model.get_submodule(k) for k in post.mean}  # the posterior's: its exclusion
    blocks = layer_blocks(layers, quant.group_size, quant.unit_groups, quant.unit.value)
    batches = None
    if quant.needs_data:
        _, batches = calibration_batches(entry, entry.load_splits(data, Path(raw)), data, calibration, seed)
    start = time.perf_counter()
    # one statistics pass (or the shared one) for every table's error-feedback metric
    metric = None
    if quant.feeds_back_table:
        stats = load_stats(Path(stats_file)) if stats_file and not post.kfac else None
        metric = ef_column_metric(post, quant, model, batches, stats=stats)
    # every grid candidate's table (only quant's own without select_grids), built together: their
    # range searches share the scoring of the ratio grid
    tables = grid_tables(post, blocks, quant, seed=seed, model=model, calibration=batches, column_metric=metric)
    table = tables.pop(next(iter(tables)))
    seconds = time.perf_counter() - start
    path = Path(out) / f"{Path(posterior_file).stem}{'_' + tag if tag else ''}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame.from_records(table.records()).to_parquet(path, index=False)
    return {"table": table, "tables": tables, "seconds": seconds, "path": str(path)}


@task(cache_policy=CACHE, persist_result=True, task_run_name="table {name} {layer}")
def layer_table_task(name: str, model_file: str, model_digest: str, posterior_file: str, posterior_sha256: str,
                     layer: str, quant, code: str):
    """One layer's closed-form loss table (:class:`bayesq.expected_loss.LayerTable`), so the
    layers of a model can be built in parallel; only for tables that read no calibration data
    (``not quant.needs_data``: the Monte Carlo proxies pick layers across the whole table, and
    the error-feedback gains and PCA metric read the calibration inputs)."""

    if quant.needs_data:
        raise ValueError(f"quant.whitening = '{quant.whitening.value}' / quant.proxy = '{quant.proxy.value}' / "
                         f"quant.feedback_table = {quant.feedback_table} read calibration data and need the "
                         "whole model's table: use table_task")
    model = load_model(get_entry(name), Path(model_file))
    post = load_posterior(model, Path(posterior_file))
    blocks = layer_blocks({layer: model.get_submodule(layer)}, quant.group_size, quant.unit_groups, quant.unit.value)
    return build_table(post, blocks, quant, progress=False).layers[0]


def config_tag(*configs) -> str:
    """Short hash naming an artifact by the settings that shape it."""
    import hashlib

    return hashlib.sha256("|".join(map(str, configs)).encode()).hexdigest()[:10]


@task(cache_policy=CACHE, persist_result=True, task_run_name="hawq traces {name} s{seed}")
def hawq_traces_task(name: str, model_file: str, model_digest: str, raw: str, raw_digest: str,
                     data, calibration, probes: int, seed: int, code: str, exclude: tuple[str, ...] = ()) -> dict:
    """HAWQ's per-layer Hutchinson Hessian traces on the seed's calibration set (timed), of the
    layers ``exclude`` does not match."""

    entry = get_entry(name)
    model = load_model(entry, Path(model_file))
    _, batches = calibration_batches(entry, entry.load_splits(data, Path(raw)), data, calibration, seed)
    start = time.perf_counter()
    traces = hessian_traces(model, batches, probes=probes, seed=seed, exclude=exclude)
    return {"traces": traces, "seconds": time.perf_counter() - start}


def _kfac_prep(params, name, model_file, mdig, src, sdig, seed, out, code, call=plain_call):
    """Posterior and table of the ``bayesq-ef`` row: K-FAC posterior, error-feedback rounding."""
    posterior, quant = method_settings(params, Method.BAYESQ_EF)
    cal = fit_inputs(params.calibration)
    post = call(f"posterior (K-FAC) {name} s{seed}", posterior_task, name, str(model_file), mdig, str(src), sdig,
                params.data, cal, posterior, seed, str(Path(out) / "posterior"), code, tag="kfac",
                exclude=params.excluded(name))
    tab = call(f"table (bayesq-ef) {name} s{seed}", table_task, name, str(model_file), mdig, post["path"],
               digest(Path(post["path"])), str(src), sdig, params.data, cal, quant, seed,
               str(Path(out) / "tables"), code, tag="ef")
    return post, tab, f"{digest(Path(post['path']))}:{quant}:{params.calibration}", quant


def _paper_prep(params, name, model_file, mdig, src, sdig, seed, out, code, call=plain_call, base=None,
                base_cfg=None):
    """Posterior and table of the ``bayesq-paper`` row, the paper-literal configuration: the
    prior precision fixed at ``posterior.damping``, the ``draws`` objective, nearest rounding, no
    bias correction. ``base`` (:func:`posterior_task`'s record of the ``base_cfg`` posterior): when
    that is a diagonal posterior differing only in its prior, its curvature is re-used
    (:func:`reprior_task`) instead of a second calibration pass."""
    posterior, quant = method_settings(params, Method.BAYESQ_PAPER)
    cal = fit_inputs(params.calibration)
    if base is not None and replace(base_cfg, prior=posterior.prior, damping=posterior.damping) == posterior \
            and Curvature(posterior.curvature) in DIAGONAL:  # the base's curvature under the fixed prior
        post = call(f"posterior (fixed prior) {name} s{seed}", reprior_task, name, str(model_file), mdig,
                    base["path"], base["sha256"], posterior, seed, str(Path(out) / "posterior"), code, "paper")
        post = {**post, "seconds": post["seconds"] + base["seconds"]}  # it needs the base's curvature pass
    else:
        post = call(f"posterior (fixed prior) {name} s{seed}", posterior_task, name, str(model_file), mdig, str(src),
                    sdig, params.data, cal, posterior, seed, str(Path(out) / "posterior"), code, tag="paper",
                    exclude=params.excluded(name))
    tab = call(f"table (bayesq-paper) {name} s{seed}", table_task, name, str(model_file), mdig, post["path"],
               digest(Path(post["path"])), str(src), sdig, params.data, cal, quant, seed,
               str(Path(out) / "tables"), code, tag="paper")
    return post, tab, f"{digest(Path(post['path']))}:{quant}:{params.calibration}", quant


def prepare(params, name: str, model_file: Path, mdig: str, src: Path, sdig: str, seed: int, out: Path,
            call=plain_call) -> tuple:
    """Cached posterior, table, K-FAC prep, layer-input statistics and HAWQ traces of one (model, seed).

    ``call``: how each task is called (a :class:`flows.timings.TaskClock` records its time).

    Every posterior, the statistics and the traces leave out the modules ``params.excluded(name)``
    matches (the posterior's layers are then the tables').

    Returns ``(post, tab, prep, hawq, stats)``: ``prep`` maps each BayesQ method to its
    ``(posterior, table, table key, quant)``; ``hawq`` is None unless HAWQ is a method;
    ``stats`` is :func:`stats_task`'s record (every method reads it or ignores it).
    """
    code, cal, exclude = prep_code(), fit_inputs(params.calibration), params.excluded(name)
    post = call(f"posterior {name} s{seed}", posterior_task, name, str(model_file), mdig, str(src), sdig,
                params.data, cal, params.posterior, seed, str(Path(out) / "posterior"), code, exclude=exclude)
    stats = call(f"layer-input statistics {name} s{seed}", stats_task, name, str(model_file), mdig, str(src), sdig,
                 params.data, cal, seed, str(Path(out) / "stats"), code, exclude=exclude)
    tab = call(f"table {name} s{seed}", table_task, name, str(model_file), mdig, post["path"],
               digest(Path(post["path"])), str(src), sdig, params.data, cal, params.quant, seed,
               str(Path(out) / "tables"), code, stats_file=stats["path"], stats_sha256=stats["sha256"])
    key = f"{digest(Path(post['path']))}:{params.quant}:{params.calibration}"
    prep = {m: (post, tab, key, params.quant) for m in (Method.BAYESQ, *SHARED_PREP)}
    if Method.BAYESQ_EF in params.methods:
        prep[Method.BAYESQ_EF] = _kfac_prep(params, name, model_file, mdig, src, sdig, seed, out, code, call)
    if Method.BAYESQ_PAPER in params.methods:
        prep[Method.BAYESQ_PAPER] = _paper_prep(params, name, model_file, mdig, src, sdig, seed, out, code, call,
                                                base=post, base_cfg=params.posterior)
    hawq = None
    if Method.HAWQ in params.methods:
        hawq = call(f"hawq traces {name} s{seed}", hawq_traces_task, name, str(model_file), mdig, str(src), sdig,
                    params.data, cal, params.baselines.config(Method.HAWQ).probes, seed, code, exclude=exclude)
    return post, tab, prep, hawq, stats
