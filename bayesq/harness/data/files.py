"""A user's data on disk, read through Hugging Face ``datasets``, drawn into disjoint seeded
calibration / selection / test examples and preprocessed into model batches.

Formats (:func:`load_rows`): a ``save_to_disk`` folder (a ``Dataset`` or a ``DatasetDict``, whose
split ``split`` is taken), a ``.parquet`` / ``.csv`` / ``.jsonl`` / ``.json`` file, or an image
folder (``class_name/image.png``, optionally under ``train/`` / ``test/``: the ``imagefolder``
builder, labels from the folder names in column ``label``).

Columns are named by the user (:class:`DataSource`): one text column or two (sentence pairs),
or an image column; a label column is optional (accuracy is reported only with one).
Preprocessing comes from the model (:func:`featurizer`): its tokenizer, its image processor, or
torchvision's standard transforms. Every problem is a ``ValueError`` naming it and the fix: a
missing column (with the columns that exist), an empty split, too few examples for the draws,
text given to an image model, labels outside the head's classes.
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from bayesq.harness.data.calibration import _permutation
from bayesq.harness.models.zoo import IMAGENET_MEAN, IMAGENET_STD

FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "json", ".json": "json"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


@dataclass(frozen=True)
class DataSource:
    """Where the examples are and which columns to read.

    Attributes:
        path: a ``save_to_disk`` folder, a Parquet / CSV / JSON Lines file or an image folder.
        split: the split of a ``DatasetDict`` folder or an image folder with split subfolders.
        text_columns: one column (single sentences) or two (sentence pairs) of text.
        image_column: the column of images (``image`` in an image folder).
        label_column: integer (or class-name) labels; ``""``: none (no accuracy).
        max_length: tokens per text input (longer ones are truncated).
        image_size: side of the square model input (torchvision transforms; the image
            processor's own size otherwise).
    """

    path: str
    split: str = "train"
    text_columns: tuple[str, ...] = ()
    image_column: str = ""
    label_column: str = ""
    max_length: int = 128
    image_size: int = 224

    def __post_init__(self) -> None:
        if isinstance(self.text_columns, str):
            object.__setattr__(self, "text_columns", (self.text_columns,))
        object.__setattr__(self, "text_columns", tuple(c for c in self.text_columns if c))
        if len(self.text_columns) > 2:
            raise ValueError(f"text columns {list(self.text_columns)}: give one column, or two for sentence pairs")
        if self.text_columns and self.image_column:
            raise ValueError("give text columns or an image column, not both")
        if self.max_length < 1:
            raise ValueError(f"max_length = {self.max_length}: must be >= 1")
        if self.image_size < 8:
            raise ValueError(f"image_size = {self.image_size}: must be >= 8")

    @property
    def modality(self) -> str:
        return "text" if self.text_columns else "image"


def _is_image_folder(path: Path) -> bool:
    return any(p.suffix.lower() in IMAGE_SUFFIXES for p in path.rglob("*") if p.is_file())


def load_rows(src: DataSource):
    """The ``datasets.Dataset`` of ``src`` (its split), not yet checked for columns.

    Raises:
        FileNotFoundError: nothing at ``src.path``.
        ValueError: a format that is not supported, a split that is not there (naming those that are).
    """
    import datasets

    path = Path(src.path)
    if not path.exists():
        raise FileNotFoundError(f"no data at {path}: pass a save_to_disk folder, a .parquet / .csv / .jsonl file "
                                "or an image folder")
    datasets.disable_progress_bars()
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"{path}: cannot read '{path.suffix}' files; use .parquet, .csv, .jsonl or .json "
                             "(or a folder written by Dataset.save_to_disk)")
        try:
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        except Exception as err:  # noqa: BLE001 - the builders raise many types on a malformed file
            if "corresponds to no data" in str(err):
                raise ValueError(f"{path} has no examples: pass a file with data") from None
            raise ValueError(f"{path} is not a readable {builder} file: {type(err).__name__}: {err}") from None
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        ds = datasets.load_from_disk(str(path))
    elif _is_image_folder(path):
        ds = datasets.load_dataset("imagefolder", data_dir=str(path))
    else:
        raise ValueError(f"{path} is neither a save_to_disk folder (dataset_dict.json / state.json) nor an image "
                         "folder (class_name/*.png): pass one of those, or a .parquet / .csv / .jsonl file")
    if isinstance(ds, datasets.DatasetDict):
        if src.split not in ds:
            raise ValueError(f"{path} has no split '{src.split}'; its splits: {', '.join(ds)} (pass --split)")
        ds = ds[src.split]
    return ds


def _missing(name: str, columns: Sequence[str], what: str, path: str) -> ValueError:
    close = difflib.get_close_matches(name, list(columns), n=1, cutoff=0.5)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ValueError(f"{what} column '{name}' is not in {path}{hint}; its columns: {', '.join(columns)}")


def check_columns(ds, src: DataSource, modality: str) -> None:
    """Raise a ValueError when a named column is missing, the data is empty, or its kind does not
    fit the model's ``modality`` (``"text"`` / ``"image"``)."""
    columns = list(ds.column_names)
    if len(ds) == 0:
        raise ValueError(f"{src.path} (split '{src.split}') has no examples: pass a file or split with data")
    if modality == "image" and src.text_columns:
        raise ValueError(f"text columns {list(src.text_columns)} given to an image model: pass --image-column "
                         "(the model reads images)")
    if modality == "text" and src.image_column:
        raise ValueError(f"image column '{src.image_column}' given to a text model: pass --text-column (the model "
                         "reads text)")
    if modality == "text" and not src.text_columns:
        raise ValueError(f"the model reads text: pass --text-column (one, or two for sentence pairs); columns of "
                         f"{src.path}: {', '.join(columns)}")
    image = src.image_column or ("image" if modality == "image" else "")
    for name, what in [(c, "text") for c in src.text_columns] + [(image, "image"), (src.label_column, "label")]:
        if name and name not in columns:
            raise _missing(name, columns, what, src.path)


@dataclass(frozen=True)
class Draws:
    """Disjoint example indices (int64, sorted) into the data: calibration, selection, test."""

    calibration: Tensor
    selection: Tensor
    test: Tensor

    def digest(self, part: str) -> str:
        """sha256 of one draw's indices (comma-separated decimal)."""
        return hashlib.sha256(",".join(map(str, getattr(self, part).tolist())).encode()).hexdigest()


DEFAULT_SIZES = {"calibration": 512, "selection": 256, "test": 512}  # benchmarks/byo_sizes.py (512: measured)
# The floor a shrunk default may reach. Calibration: the smallest size measured (benchmarks/byo_sizes.py,
# 2026-12-07), at which BayesQ still beat GPTQ by a resolved KL margin on MiniLM and on lite0 (docs/usage.md);
# selection may vanish (the candidates are then scored on the calibration inputs); a test draw as small.
MIN_SIZES = {"calibration": 8, "selection": 0, "test": 8}


@dataclass(frozen=True)
class DrawSizes:
    """The three draw sizes a run takes from ``n_total`` examples, and why (``note``: "" when
    every size is the one given or the default)."""

    calibration: int
    selection: int
    test: int
    note: str = ""


def fit_draw_sizes(n_total: int, calibration: int | None = None, selection: int | None = None,
                   test: int | None = None) -> DrawSizes:
    """Draw sizes that fit ``n_total`` examples: sizes given are kept; those left None take their
    :data:`DEFAULT_SIZES`, all scaled by one factor ``f = (n_total - given) / defaults`` (rounded
    down) when they do not fit, so a few hundred examples run with no flags.

    Every size given: returned as it is (:func:`draw_examples` refuses sizes that do not fit).

    Raises:
        ValueError: a given size below 1 (selection: below 0); the sizes given exceeding
            ``n_total`` while others are left to the default; a shrunk default below its
            :data:`MIN_SIZES` floor (the message names the fewest examples that run with the
            defaults, and the flags to set instead).
    """
    given = {"calibration": calibration, "selection": selection, "test": test}
    for key, v in given.items():
        if v is not None and v < (0 if key == "selection" else 1):
            raise ValueError(f"{key} = {v}: need at least {0 if key == 'selection' else 1} example(s)")
    fixed = sum(v for v in given.values() if v is not None)
    free = {k: DEFAULT_SIZES[k] for k, v in given.items() if v is None}
    if fixed + sum(free.values()) <= n_total:
        return DrawSizes(**{**given, **free})
    flags = " / ".join(f"--{k}" for k in given)
    if not free:  # every size given: never shrunk (draw_examples names what does not fit)
        return DrawSizes(calibration, selection, test)
    if fixed > n_total:
        need = " + ".join(f"{k} {v}" for k, v in given.items() if v is not None)
        raise ValueError(f"the data has {n_total} examples but the sizes given need {need} = {fixed}: pass smaller "
                         f"{flags} (they must add up to at most {n_total}) or more data")
    f = (n_total - fixed) / sum(free.values())
    shrunk = {k: int(v * f) for k, v in free.items()}
    low = {k: v for k, v in shrunk.items() if v < MIN_SIZES[k]}
    if low:
        least = fixed + max(-(-MIN_SIZES[k] * sum(free.values()) // free[k]) for k in free)
        while any(int(v * (least - fixed) / sum(free.values())) < MIN_SIZES[k] for k, v in free.items()):
            least += 1  # rounding down may need one more
        k = next(iter(low))
        raise ValueError(f"the data has {n_total} examples: the default draws shrunk to fit would leave {shrunk[k]} "
                         f"{k} examples, below the {MIN_SIZES[k]} that measurement supports (benchmarks/byo_sizes.py); "
                         f"bring at least {least} examples, or pass {flags} yourself")
    sizes = {**given, **shrunk}
    note = (f"the data has {n_total} examples, fewer than the default draws need "
            f"({' + '.join(str(DEFAULT_SIZES[k]) for k in free)}{' plus the sizes given' if fixed else ''}): "
            f"the defaults scaled by {f:.2f}")
    return DrawSizes(sizes["calibration"], sizes["selection"], sizes["test"], note)


def draw_examples(n_total: int, calibration: int, selection: int, test: int, seed: int) -> Draws:
    """Three disjoint seeded draws from one seeded permutation of ``range(n_total)`` (the one
    :func:`bayesq.harness.data.calibration.sample_calibration_indices` takes its first indices
    from), each sorted: the test draw is its first ``test`` entries, the selection draw the next
    ``selection``, the calibration draw the next ``calibration``. The test examples therefore
    depend on the seed and ``test`` only: runs with other calibration or selection sizes are
    scored on the same examples and can be compared pairwise.

    Raises:
        ValueError: a size below 1 (selection may be 0), or fewer examples than the three need.
    """
    if calibration < 1 or test < 1 or selection < 0:
        raise ValueError(f"draw sizes calibration = {calibration}, selection = {selection}, test = {test}: "
                         "calibration and test need at least 1 example")
    need = calibration + selection + test
    if n_total < need:
        raise ValueError(f"the data has {n_total} examples but calibration + selection + test need "
                         f"{calibration} + {selection} + {test} = {need}: pass smaller --calibration / --selection "
                         f"/ --test (they must add up to at most {n_total}) or more data")
    perm = _permutation(n_total, seed)
    cuts = (0, test, test + selection, need)
    t, s, c = (torch.sort(perm[a:b]).values for a, b in zip(cuts, cuts[1:]))
    return Draws(calibration=c, selection=s, test=t)


def read_labels(ds, idx: Tensor, src: DataSource, num_classes: int, label2id: dict | None = None) -> Tensor | None:
    """(n,) int64 labels of rows ``idx`` (None without a label column). Class names are mapped by
    ``label2id`` (a Hugging Face config's).

    Raises:
        ValueError: labels that are neither integers nor known class names, or outside
            ``[0, num_classes)`` (``num_classes`` > 0).
    """
    if not src.label_column:
        return None
    values = ds.select(idx.tolist())[src.label_column]
    if values and isinstance(values[0], str):
        table = {str(k): int(v) for k, v in (label2id or {}).items()}
        unknown = sorted({v for v in values if v not in table})
        if unknown:
            raise ValueError(f"label column '{src.label_column}' holds class names {unknown[:4]} the model does not "
                             f"know ({'its classes: ' + ', '.join(table) if table else 'it has no label2id'}): "
                             "store integer class indices")
        values = [table[v] for v in values]
    try:
        labels = torch.tensor(values, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"label column '{src.label_column}' must hold integer class indices (got "
                         f"{type(values[0]).__name__} values)") from None
    if num_classes > 0 and len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        bad = sorted({int(v) for v in labels if not 0 <= v < num_classes})
        raise ValueError(f"labels outside the head's classes: column '{src.label_column}' holds {bad[:5]} but the "
                         f"model has {num_classes} classes (0..{num_classes - 1}): pass the label column of this "
                         "model's task, or a model with a head of that many classes")
    return labels


def featurizer(pre: dict[str, Any], src: DataSource, folder: Path | None = None) -> Callable[[dict[str, list]], Any]:
    """A function from a dict of column lists (a ``Dataset`` slice) to one model batch.

    ``pre``: the model source's preprocessor description (:meth:`bayesq.harness.sources.ModelSource.preprocessor`);
    ``folder``: where its files are unpacked (tokenizer / image processor). Text: a dict of
    int64 (B, L) ``input_ids`` / ``attention_mask`` (/ ``token_type_ids``), padded to the batch's
    longest input (right side), truncated to ``src.max_length``; a tokenizer without a padding
    token (GPT-2) pads with its end-of-text token (masked). Images: float32 (B, 3, S, S), or
    ``{"pixel_values": ...}`` for a Hugging Face image processor.
    """
    kind = pre["kind"]
    if kind == "tokenizer":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
        tok.padding_side = "right"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        cols = src.text_columns

        def text(rows: dict[str, list]) -> dict[str, Tensor]:
            args = [[str(v) for v in rows[c]] for c in cols]
            enc = tok(*args, padding="longest", truncation=True, max_length=src.max_length, return_tensors="pt")
            return {k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
        return text
    column = src.image_column or "image"
    if kind == "image-processor":
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(str(folder))

        def processed(rows: dict[str, list]) -> dict[str, Tensor]:
            return {"pixel_values": proc([_rgb(im) for im in rows[column]], return_tensors="pt")["pixel_values"]}
        return processed
    if kind == "torchvision":
        from torchvision import transforms as T

        size = int(src.image_size)
        tf = T.Compose([T.Resize(max(size, round(size * 256 / 224))), T.CenterCrop(size), T.ToTensor(),
                        T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
        return lambda rows: torch.stack([tf(_rgb(im)) for im in rows[column]])
    raise ValueError(f"no preprocessing of kind {kind!r} for a user's data (embedded models read their own data)")


def _rgb(image):
    """A PIL image in RGB (grayscale and RGBA converted; arrays and nested lists accepted)."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        import numpy as np

        image = Image.fromarray(np.asarray(image, dtype=np.uint8))
    return image.convert("RGB")


def make_batches(ds, idx: Tensor, featurize: Callable[[dict[str, list]], Any], batch_size: int = 32,
                 desc: str | None = None) -> list:
    """Batches of the rows ``idx`` (in that order), ``batch_size`` each (the last shorter);
    ``desc``: a progress bar over the batches with that label."""
    rows = idx.tolist()
    starts = tqdm(range(0, len(rows), batch_size), desc=desc, disable=None if desc else True, leave=False)
    return [featurize(ds.select(rows[i:i + batch_size])[:]) for i in starts]
