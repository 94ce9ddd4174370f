"""Calibration and out-of-domain evaluation used by the quantize stage (I/O side).

``evaluate_model`` gives a model's test-split summary (:func:`bayesq.evaluation.prediction_summary`)
and, when asked, its accuracy / ECE on corrupted test images (vision) or on the other domains of
the sentiment archive (text).  ``fp_eval_task`` caches the same for the full-precision model, the
reference of the mean corruption error, and writes its test logits to
``<results>/examples/<model>_fp_logits.safetensors``; every quantised row is then compared with them
example by example (``bayesq.comparison``: KL to FP, top-1 agreement, correctness), written to
``<results>/examples/<model>_<method>_b<budget>_s<seed>.safetensors`` for the paired comparisons of
the report.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task

from bayesq.comparison import agreement_per_example, correct_per_example, fidelity_summary, kl_per_example
from bayesq.evaluation import predict, prediction_summary
from bayesq.harness.corruptions import corrupt, corruption_errors_to_mce
from bayesq.harness.data.sentiment import binary_labels, load_vader_domain, seeded_permutation
from bayesq.harness.models.zoo import _take, get_entry
from bayesq.metrics import calibration_error, topk_accuracy
from bayesq.tensorfile import file_sha256, save_tensors
from flows.common import CACHE
from flows.finetune import load_model

CORRUPTION_SEED = 0  # every model sees the same corrupted images
EXAMPLES = "examples"  # per-example files under the results folder
DOMAIN_SEED = 0


def _accuracy_ece(logit, labels, rob) -> dict:

    p = logit.double().softmax(-1)
    return {"accuracy": topk_accuracy(p, labels), "ece": calibration_error(p, labels, rob.ece_bins)["ece"]}


def domain_split(raw: Path, domain: str, n: int):
    """First ``n`` labelled sentences of ``domain`` (seeded order), sorted by length for batching."""
    import torch


    sentences, labels = binary_labels(load_vader_domain(Path(raw), domain))
    idx = seeded_permutation(len(sentences), DOMAIN_SEED)[:n].tolist()
    idx.sort(key=lambda i: len(sentences[i]))
    return [sentences[i] for i in idx], labels[torch.tensor(idx, dtype=torch.int64)]


def ood_eval(entry, model, splits, data, raw: Path, rob) -> dict:
    """Accuracy and ECE under shift: ``{"corruptions": {name: {severity: {...}}}, "clean": {...}}``
    for image entries, ``{"domains": {domain: {...}}}`` for text entries."""

    if entry.task == "image":
        images = splits.test_inputs[: rob.corruption_examples]
        labels = splits.test_labels[: rob.corruption_examples]
        out = {"clean": _accuracy_ece(predict(model, entry.batches(images, 100, data)), labels, rob),
               "corruptions": {}}
        for name in rob.corruptions:
            out["corruptions"][name] = {}
            for s in rob.severities:
                x = corrupt(images, name, s, seed=CORRUPTION_SEED)
                out["corruptions"][name][str(s)] = _accuracy_ece(predict(model, entry.batches(x, 100, data)),
                                                                 labels, rob)
        return out
    out = {"domains": {}}
    for domain in rob.text_domains:
        sentences, labels = domain_split(raw, domain, rob.domain_examples)
        out["domains"][domain] = _accuracy_ece(predict(model, entry.batches(sentences, 64, data)), labels, rob)
    return out


def fp_logits_file(examples: Path, model: str) -> Path:
    """The FP model's saved test logits: ``<examples>/<model>_fp_logits.safetensors``."""
    return Path(examples) / f"{model}_fp_logits.safetensors"


def save_fp_logits(path: Path, logit, labels, model: str) -> str:
    """Write ``logits`` ((N, C) float32) and ``labels`` ((N,) int64) to ``path``; their sha256."""

    save_tensors(path, {"logits": logit.float().contiguous(), "labels": labels.long().contiguous()},
                 {"model": model})
    return file_sha256(path)


def read_tensors(path: Path) -> dict:
    """Every tensor of a safetensors file (CPU)."""
    from safetensors.torch import load_file

    return load_file(str(path))


def example_scores(logit, labels, fp_file: Path, examples: Path, model: str) -> dict | None:
    """Per-example comparison of a row's test logits with the FP model's (``fp_file``).

    Writes ``examples`` with ``correct`` ((N,) uint8), ``kl`` ((N,) float32, nats; KL(p_FP || p_Q))
    and ``agree`` ((N,) uint8, top-1 agreement with FP); returns the record fields ``kl_mean``,
    ``kl_se``, ``agreement`` and ``examples_file``, or None (with a warning) when the FP logits
    are missing or belong to another test split.
    """
    import torch


    if not Path(fp_file).exists():
        print(f"[evaluate] no FP logits at {fp_file}: no KL / agreement for {Path(examples).stem}", flush=True)
        return None
    fp = read_tensors(fp_file)
    if fp["labels"].shape != labels.shape or not bool((fp["labels"] == labels).all()):
        print(f"[evaluate] {fp_file} holds another test split: no KL / agreement for {Path(examples).stem}",
              flush=True)
        return None
    kl, agree = kl_per_example(fp["logits"], logit), agreement_per_example(fp["logits"], logit)
    correct = correct_per_example(logit, labels)
    save_tensors(examples, {"correct": correct.to(torch.uint8), "kl": kl.float(), "agree": agree.to(torch.uint8)},
                 {"model": model, "fp_logits_sha256": file_sha256(fp_file)})
    return {**fidelity_summary(kl, agree).as_dict(), "examples_file": str(examples)}


def evaluate_model(entry, model, splits, data, raw: Path, rob, ood: bool, seed: int,
                   examples: Path | None = None, fp_file: Path | None = None) -> dict:
    """``{"calibration": test summary, "ood": shifted-data results or None}``.

    With ``examples`` (``<results>/examples/<row>.safetensors``) and the FP model's test logits
    (``fp_file``, default :func:`fp_logits_file` next to ``examples``; written by
    :func:`fp_eval_task`), also the per-example comparison with FP (:func:`example_scores`):
    ``kl_mean``, ``kl_se``, ``agreement`` and ``examples_file``.
    """
    res, logit = _evaluate(entry, model, splits, data, raw, rob, ood, seed)
    if examples is not None:
        fp_file = Path(fp_file) if fp_file is not None else fp_logits_file(Path(examples).parent, entry.name)
        res.update(example_scores(logit, splits.test_labels, fp_file, Path(examples), entry.name) or {})
    return res


def _evaluate(entry, model, splits, data, raw: Path, rob, ood: bool, seed: int):
    """(:func:`evaluate_model`'s summary, (N, C) float32 test logits)."""

    logit = _predict_in_padding_order(entry, model, splits.test_inputs, data)
    summary = prediction_summary(logit, splits.test_labels, rob.ece_bins, rob.random_bin_repeats, seed)
    return {"calibration": summary, "ood": ood_eval(entry, model, splits, data, raw, rob) if ood else None}, logit


def _predict_in_padding_order(entry, model, inputs, data, batch_size: int = 64):
    """(N, C) logits of ``inputs`` in their own order, computed in :meth:`ZooEntry.padding_order`
    (sentences by length: less padding per batch; padding is masked, so each row is as in any order)."""
    import torch


    if entry.lengths(inputs) is None:  # inputs of one shape: nothing to gain
        return predict(model, entry.batches(inputs, batch_size, data))
    order = entry.padding_order(inputs)
    ordered = predict(model, entry.batches(_take(inputs, order), batch_size, data))
    logit = torch.empty_like(ordered)
    logit[order] = ordered
    return logit


@task(cache_policy=CACHE, persist_result=True, task_run_name="FP evaluation {name}")
def fp_eval_task(name: str, model_file: str, model_digest: str, raw: str, raw_digest: str, data, robustness,
                 seed: int, code: str, out: str | None = None) -> dict:
    """The full-precision model's test summary and out-of-domain results (the mCE reference).

    With ``out`` (the results folder) its test logits are written to
    ``fp_logits_file(<out>/examples, name)``; the record names it (``logits_file``, ``logits_sha256``).
    """

    entry = get_entry(name)
    model = load_model(entry, Path(model_file))
    splits = entry.load_splits(data, Path(raw))
    res, logit = _evaluate(entry, model, splits, data, Path(raw), robustness, True, seed)
    if out is not None:
        path = fp_logits_file(Path(out) / EXAMPLES, name)
        res.update(logits_file=str(path), logits_sha256=save_fp_logits(path, logit, splits.test_labels, name))
    return {"model": name, "method": "fp", "budget": 32.0, "seed": seed,
            "accuracy": res["calibration"]["accuracy"], "avg_bits": 32.0, **res}


def mean_corruption_error(ood: dict, fp_ood: dict) -> dict | None:
    """``{"mce": mCE, "ce": {corruption: CE}, "undefined": [...]}`` of an image row against the FP
    row (corruptions on which the FP model makes no error have no CE and are left out), else None."""

    if not ood or "corruptions" not in ood or not fp_ood:
        return None

    def errors(o: dict) -> dict:
        return {c: [1 - v["accuracy"] for _, v in sorted(sev.items(), key=lambda kv: int(kv[0]))]
                for c, sev in o["corruptions"].items()}

    ref = errors(fp_ood)
    defined = [c for c, e in ref.items() if sum(e) > 0]  # the FP model makes no error: CE undefined
    if not defined:
        return None
    mce, ce = corruption_errors_to_mce({c: e for c, e in errors(ood).items() if c in defined},
                                       {c: ref[c] for c in defined})
    return {"mce": mce, "ce": ce, "undefined": sorted(set(ref) - set(defined))}


def tracked_metrics(record: dict) -> dict[str, float]:
    """Flat calibration / tail / shift metrics of a record, for MLflow."""
    cal = record.get("calibration") or {}
    out = {k: cal[k] for k in ("ece", "mce", "ece_random", "nll", "worst5", "worst10", "cvar90", "cvar95",
                                "top5", "f1") if k in cal}
    if record.get("corruption"):
        out["mce_corruption"] = record["corruption"]["mce"]
    for domain, v in ((record.get("ood") or {}).get("domains") or {}).items():
        out[f"ood_{domain}_accuracy"] = v["accuracy"]
        out[f"ood_{domain}_ece"] = v["ece"]
    return out
