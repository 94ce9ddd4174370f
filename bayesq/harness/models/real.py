"""Zoo entries for real checkpoints and data sets that a user has on disk.

``ResNet50ImageNet`` (``bayesq.harness.models.imagenet``): torchvision ResNet-50 (any torchvision
classifier via ``arch``) on an ImageNet folder in ``ImageFolder`` layout
(``<root>/val/<wnid>/*.JPEG``, optional ``train/``); sorted folder names are the label ids (for
the 1000 WordNet ids: torchvision's class order).
``BertGLUE`` (``bayesq.harness.models.glue``): a Hugging Face sequence classifier (local directory or
cached hub id) on one GLUE task read from the official TSVs, evaluated on dev with the official
metrics (``bayesq.metrics``). Their public names are re-exported here.

Nothing is loaded or registered at import. Register entries in the process that runs the
pipeline, then use them by name (``get_entry("bert-sst2")``)::

    register_real(imagenet_root="/data/imagenet", resnet_weights="IMAGENET1K_V2", glue_dir="/data/glue",
                  bert_models={"sst2": "/ckpt/bert-sst2", "mnli-m": "/ckpt/bert-mnli"})
    # or: bayesq.harness.models.zoo.register(BertGLUE("/ckpt/bert-qqp", Path("/data/glue"), "qqp"))

``DataConfig.image_*_subset`` / ``text_*_subset`` cap the splits (seeded subsets; set the test
caps above the val/dev size for official full-set numbers). Preprocessing follows the entry's
``image_size`` / ``max_length``, not ``DataConfig.image_size`` / ``text_max_length``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from bayesq.harness.models.glue import GLUE_SPECS, BertGLUE, GlueTaskSpec, predictions, read_glue_tsv
from bayesq.harness.models.imagenet import (
    STATE_DICT_SUFFIXES,
    ImageBatches,
    ResNet50ImageNet,
    holdout_split,
    image_folder,
    imagenet_eval_transform,
    load_image,
    read_state_dict,
    torchvision_weights_file,
)
from bayesq.harness.models.zoo import ZooEntry, known_models, register

__all__ = [
    "GLUE_SPECS",
    "STATE_DICT_SUFFIXES",
    "BertGLUE",
    "GlueTaskSpec",
    "ImageBatches",
    "ResNet50ImageNet",
    "holdout_split",
    "image_folder",
    "imagenet_eval_transform",
    "load_image",
    "predictions",
    "read_glue_tsv",
    "read_state_dict",
    "register_real",
    "torchvision_weights_file",
]


def register_real(
    *, imagenet_root: str | Path | None = None, resnet_weights: str | Path | None = None,
    glue_dir: str | Path | None = None, bert_models: Mapping[str, str | Path] | None = None,
    replace: bool = False,
) -> tuple[str, ...]:
    """Register the real entries in ``bayesq.harness.models.zoo`` (this process only); returns names.

    ``imagenet_root`` or ``resnet_weights`` given: ``ResNet50ImageNet(resnet_weights,
    imagenet_root)`` as ``"resnet50-imagenet"``. ``bert_models``: GLUE task -> checkpoint, each
    as ``BertGLUE(checkpoint, glue_dir, task)`` named ``"bert-<task>"``. All entries and names
    are checked before any is registered: ValueError for ``bert_models`` without ``glue_dir``,
    an unknown task, or a name already registered (unless ``replace``).
    """
    entries: list[ZooEntry] = []
    if imagenet_root is not None or resnet_weights is not None:
        entries.append(ResNet50ImageNet(resnet_weights, None if imagenet_root is None else Path(imagenet_root)))
    if bert_models:
        if glue_dir is None:
            raise ValueError("register_real: bert_models needs glue_dir (the GLUE data folder)")
        entries += [BertGLUE(m, Path(glue_dir), task) for task, m in bert_models.items()]
    taken = [e.name for e in entries if e.name in known_models()]
    if taken and not replace:
        raise ValueError(f"model(s) {taken} already registered (pass replace=True)")
    for entry in entries:
        register(entry, replace=replace)
    return tuple(e.name for e in entries)
