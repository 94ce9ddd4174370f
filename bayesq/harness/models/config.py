"""Settings of the embedded models' harness (``data`` and ``finetune`` in ``params.yaml``): the
sizes of the embedded data sets and the fine-tuning recipe, read by :mod:`bayesq.harness.models.zoo`,
:mod:`bayesq.harness.models.glue` and :mod:`bayesq.harness.models.imagenet`. Validated like the method configs
(:func:`bayesq.settings.validate`)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesq.settings import above, at_least, integer, rule, setting, validate, within


@dataclass(frozen=True)
class DataConfig:
    """Sizes of the embedded data sets (the default profile keeps a cold run short)."""

    image_size: int = setting(64, rule(lambda v: v >= 32, "must be >= 32 for EfficientNet-Lite0"))
    image_train_subset: int = setting(12000, at_least(1))
    image_test_subset: int = setting(2000, at_least(1))
    text_max_length: int = setting(64, at_least(1))
    text_test_fraction: float = setting(0.2, within("(0, 1)"))
    text_train_subset: int = setting(3000, at_least(1))
    text_test_subset: int = setting(1000, at_least(1))
    split_seed: int = 0

    def __post_init__(self) -> None:
        validate(self, "data")


@dataclass(frozen=True)
class FinetuneConfig:
    """Fine-tuning of the embedded models (a cached pipeline step).

    ``threads``: torch intra-op threads during fine-tuning. Float32 reductions split over threads
    sum in a thread-dependent order, and AdamW turns those last-bit differences into different
    weights, so the fine-tuned model depends on the thread count; a fixed count makes it the same
    on machines with another number of cores (0: torch's default, the machine's core count).

    ``frozen_backbone``: models whose pretrained backbone stays as shipped; only their new head is
    trained, for ``head_epochs`` epochs on the backbone's features (computed once, eval mode).
    Training every weight of a convolutional net amplifies the CPU kernels' last-bit rounding
    into a different model on another CPU; a head on fixed features is the same model there.

    ``length_groups``: for inputs of varying length (sentences), each epoch's shuffled order is
    cut into chunks of this many mini-batches, each chunk sorted by length before it is cut into
    mini-batches, and the mini-batches are then shuffled (Hugging Face's ``group_by_length``):
    batches padded to their longest member then carry little padding. 0: plain shuffled batches.
    """

    epochs: int = setting(1, at_least(1))
    scratch_epochs: int = setting(3, at_least(1))  # models trained from random initialisation (resnet18-fmnist)
    batch_size: int = setting(64, at_least(1))
    lr_image: float = setting(1e-3, above(0))
    lr_text: float = setting(5e-5, above(0))
    weight_decay: float = 0.01
    seed: int = 0
    threads: int = setting(2, integer(0, "0: torch's default"))
    frozen_backbone: tuple[str, ...] = setting(
        (), rule(lambda v: not isinstance(v, str) and all(isinstance(m, str) for m in v),
                 "must be a list of model names, e.g. [lite0-fmnist]"), convert=tuple)
    head_epochs: int = setting(3, at_least(1))
    length_groups: int = setting(50, integer(0, "0: no grouping by length"))

    def __post_init__(self) -> None:
        validate(self, "finetune")
