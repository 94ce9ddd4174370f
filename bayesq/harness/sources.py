"""Model sources: what a user types for a model, turned into a built ``nn.Module``, how to
preprocess its inputs, and a JSON description that rebuilds its skeleton without the producer's
code (stored in every export, read by :func:`bayesq.export.load`).

What :func:`resolve_model` accepts:

``./my-bert`` (a Hugging Face model directory)
    ``config.json`` plus weights (``model.safetensors`` / ``pytorch_model.bin``, sharded or not),
    loaded with the ``Auto*`` class its config's ``architectures`` names: ``...ForSequenceClassification``
    -> ``AutoModelForSequenceClassification``, ``...ForCausalLM`` / ``...LMHeadModel`` ->
    ``AutoModelForCausalLM``, ``...ForMaskedLM`` -> ``AutoModelForMaskedLM``,
    ``...ForImageClassification`` -> ``AutoModelForImageClassification``, anything else the base
    ``AutoModel``. Inputs are preprocessed by the directory's ``AutoTokenizer`` (text) or
    ``AutoImageProcessor`` (images).
``torchvision:<arch>`` with ``checkpoint=`` (a state dict, ``.pth``/``.pt`` or ``.safetensors``)
    ``torchvision.models.get_model(arch, num_classes=...)``; the class count is read from the
    checkpoint's last Linear layer when not given. Inputs: torchvision's standard ImageNet
    transforms (resize to 256/224 of the size, centre crop, ImageNet mean/std).
``package.module:function``
    ``function()`` must return an ``nn.Module`` (its weights as they come, or ``checkpoint=``
    loaded into it). Images get the torchvision transforms; text needs ``tokenizer=`` (a
    folder :func:`transformers.AutoTokenizer.from_pretrained` reads). Its export's skeleton is
    the same call, so loading it needs that package importable.
an embedded name (``lite0-fmnist``, ...)
    the zoo entry (:mod:`bayesq.harness.models.zoo`); its fine-tuned weights come from
    ``checkpoint=`` (the pipeline's ``models/<name>/model.safetensors``).

Everything that can be wrong is a ``ValueError`` / ``FileNotFoundError`` naming the problem and
the fix (a directory that is not a model, a checkpoint whose keys do not match the arch, an
unknown arch, a function that returns no module).
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import tempfile
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bayesq.harness.models.zoo import get_entry, known_models

#: Auto class by the suffix of the config's architecture name (first match wins).
AUTO_CLASSES = (
    ("ForSequenceClassification", "AutoModelForSequenceClassification"),
    ("ForCausalLM", "AutoModelForCausalLM"),
    ("LMHeadModel", "AutoModelForCausalLM"),
    ("ForMaskedLM", "AutoModelForMaskedLM"),
    ("ForImageClassification", "AutoModelForImageClassification"),
)
BASE_AUTO = "AutoModel"
#: transformers' loading patches module-level state (weight initialisation, tied weights), so two
#: threads loading at once (tasks of a flow's thread pool) can corrupt each other: one at a time.
_HF_LOAD = threading.Lock()
#: Files of a tokenizer / image processor an export carries so its inputs can be preprocessed
#: without the model directory.
PREPROCESSOR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                      "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "added_tokens.json",
                      "preprocessor_config.json")


class SourceKind(str, Enum):
    """Where a model comes from."""

    HUGGINGFACE = "huggingface"
    TORCHVISION = "torchvision"
    CALLABLE = "callable"
    EMBEDDED = "embedded"


class Modality(str, Enum):
    """What the model reads."""

    TEXT = "text"
    IMAGE = "image"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model source (a value: no module is held; :meth:`build` makes one).

    Attributes:
        spec: what the user typed (a directory, ``torchvision:<arch>``, ``pkg.mod:fn``, a name).
        kind: :class:`SourceKind`.
        checkpoint: weights file (torchvision, callable, embedded); ``""``: none.
        num_classes: the classifier's output width (0: read from the model).
        auto_class: the ``transformers`` Auto class (Hugging Face sources).
        modality: text or image inputs.
        causal_lm: a causal language model (per-token logits predicting the next token).
        tokenizer: a tokenizer folder (callable sources reading text).
    """

    spec: str
    kind: SourceKind
    checkpoint: str = ""
    num_classes: int = 0
    auto_class: str = ""
    modality: Modality = Modality.IMAGE
    causal_lm: bool = False
    tokenizer: str = ""

    @property
    def headless(self) -> bool:
        """A Hugging Face base model (``AutoModel``): features, no head (:class:`bayesq.forward.Likelihood`)."""
        return self.kind is SourceKind.HUGGINGFACE and self.auto_class == BASE_AUTO

    @property
    def arch(self) -> str:
        """torchvision arch name, or the callable's ``pkg.mod:fn``."""
        return self.spec.split(":", 1)[1] if self.kind is SourceKind.TORCHVISION else self.spec

    def build(self) -> nn.Module:
        """The model with its weights, in eval mode, on the CPU; a Hugging Face checkpoint stored in
        fp16 / bf16 is loaded in float32 (the curvature and statistics passes run in it)."""
        if self.kind is SourceKind.HUGGINGFACE:
            return _hf_pretrained(self).eval()
        if self.kind is SourceKind.EMBEDDED:
            from safetensors.torch import load_model

            entry = get_entry(self.spec)
            model = entry.build(pretrained=False)
            if not self.checkpoint:
                raise ValueError(f"embedded model '{self.spec}' needs its fine-tuned weights: pass checkpoint= "
                                 f"(the pipeline writes models/{self.spec}/model.safetensors)")
            load_model(model, _existing(self.checkpoint, "checkpoint"))
            return model.eval()
        model = self.skeleton_module()
        if self.checkpoint:
            load_checkpoint(model, Path(self.checkpoint), self.spec)
        return model.eval()

    def skeleton_module(self) -> nn.Module:
        """The architecture with initial (random) weights."""
        return build_skeleton(self.skeleton())

    def skeleton(self) -> dict[str, Any]:
        """JSON-able description :func:`build_skeleton` rebuilds the architecture from."""
        if self.kind is SourceKind.HUGGINGFACE:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.spec)
            return {"kind": self.kind.value, "auto_class": self.auto_class, "config": config.to_dict(),
                    "attn_implementation": getattr(config, "_attn_implementation", None) or "sdpa"}
        if self.kind is SourceKind.TORCHVISION:
            return {"kind": self.kind.value, "arch": self.arch, "num_classes": self.num_classes}
        if self.kind is SourceKind.CALLABLE:
            return {"kind": self.kind.value, "target": self.spec}
        return {"kind": self.kind.value, "name": self.spec}

    def preprocessor(self, image_size: int = 224) -> dict[str, Any]:
        """JSON-able description of the input preprocessing (:func:`bayesq.harness.data.files.featurizer`):
        ``{"kind": "tokenizer" | "image-processor", "files": {name: base64}}`` with the model
        directory's files, or ``{"kind": "torchvision", "image_size": S}``; ``{"kind": "embedded"}``
        for an embedded model (its zoo entry preprocesses)."""
        if self.kind is SourceKind.EMBEDDED:
            return {"kind": "embedded", "name": self.spec}
        folder = self.spec if self.kind is SourceKind.HUGGINGFACE else self.tokenizer
        if self.modality is Modality.TEXT:
            if not folder:
                raise ValueError(f"model '{self.spec}' reads text but no tokenizer is known: pass tokenizer= "
                                 "(a folder AutoTokenizer.from_pretrained reads)")
            return {"kind": "tokenizer", "files": _folder_files(Path(folder))}
        if self.kind is SourceKind.HUGGINGFACE and (Path(folder) / "preprocessor_config.json").is_file():
            return {"kind": "image-processor", "files": _folder_files(Path(folder))}
        return {"kind": "torchvision", "image_size": int(image_size)}


def _existing(path: str | Path, what: str) -> str:
    if not Path(path).is_file():
        raise FileNotFoundError(f"no {what} file at {path}: check the path")
    return str(path)


def _folder_files(folder: Path) -> dict[str, str]:
    """The preprocessing files of a model or tokenizer folder, base64-encoded."""
    files = {n: base64.b64encode((folder / n).read_bytes()).decode() for n in PREPROCESSOR_FILES
             if (folder / n).is_file()}
    if not files:
        raise FileNotFoundError(f"{folder} holds no tokenizer or image processor files ({', '.join(PREPROCESSOR_FILES[:4])}, "
                                "...): save them next to the model with tokenizer.save_pretrained(folder)")
    return files


@contextlib.contextmanager
def unpacked(files: dict[str, str]):
    """A temporary folder holding base64 ``files`` (name -> content), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="bayesq-pre-") as tmp:
        for name, content in files.items():
            (Path(tmp) / Path(name).name).write_bytes(base64.b64decode(content))
        yield Path(tmp)


def auto_class_for(architectures: list[str] | None) -> str:
    """The Auto class for a config's ``architectures`` (:data:`AUTO_CLASSES`; else the base model)."""
    name = (architectures or [""])[0]
    return next((auto for suffix, auto in AUTO_CLASSES if name.endswith(suffix)), BASE_AUTO)


def _hf_config(folder: Path):
    from transformers import AutoConfig

    if not folder.is_dir():
        raise FileNotFoundError(f"no model at {folder}: pass a Hugging Face model directory, torchvision:<arch>, "
                                "package.module:function or an embedded model name")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a model directory: it has no config.json (a Hugging Face model "
                         "directory holds config.json and model.safetensors; write one with "
                         "model.save_pretrained(folder))")
    try:
        return AutoConfig.from_pretrained(str(folder))
    except (ValueError, OSError, KeyError) as err:
        raise ValueError(f"{folder}/config.json is not a Hugging Face config transformers can read: {err}") from None


@contextlib.contextmanager
def quiet_transformers():
    """transformers' info messages and progress bars off inside (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _hf_pretrained(src: ModelSource) -> nn.Module:
    """``Auto*.from_pretrained`` of the directory; keys the checkpoint lacks or has extra raise."""
    import transformers

    cls = getattr(transformers, src.auto_class)
    folder = Path(src.spec)
    if not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin")):
        raise ValueError(f"{folder} has a config.json but no weights (model.safetensors or pytorch_model.bin): "
                         "save the model with model.save_pretrained(folder)")
    with _HF_LOAD, quiet_transformers():
        try:
            model, info = cls.from_pretrained(str(folder), output_loading_info=True, dtype=torch.float32)
        except (ValueError, OSError, RuntimeError) as err:
            raise ValueError(f"{folder}: {src.auto_class} cannot load this checkpoint: {err}") from None
    bad = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(bad.values()):
        said = "; ".join(f"{k.replace('_', ' ')}: {', '.join(v[:4])}{' ...' if len(v) > 4 else ''}"
                         for k, v in bad.items() if v)
        raise ValueError(f"{folder}: the weights do not match the {src.auto_class} its config names ({said}): "
                         "save the model you want quantised with save_pretrained")
    return model


def _torchvision_num_classes(arch: str, state: dict[str, torch.Tensor]) -> int:
    """Output width of ``arch``'s last Linear layer in ``state``."""
    from torchvision.models import get_model

    probe = get_model(arch, weights=None)
    last = [n for n, m in probe.named_modules() if isinstance(m, nn.Linear)]
    key = f"{last[-1]}.weight" if last else ""
    if key not in state:
        raise ValueError(f"cannot read the class count of torchvision:{arch} from the checkpoint (no '{key}'): "
                         "pass the number of classes")
    return int(state[key].shape[0])


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or a torch file (``.pth``/``.pt``/``.bin``: a state dict,
    or one under ``state_dict`` / ``model``; a ``module.`` prefix from DataParallel is dropped)."""
    path = Path(_existing(path, "checkpoint"))
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        try:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - torch raises many types for a bad file
            raise ValueError(f"{path} is not a readable torch checkpoint ({type(err).__name__}: {err})") from None
        for key in ("state_dict", "model"):
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError(f"{path} does not hold a state dict (name -> tensor): save one with "
                         "torch.save(model.state_dict(), path) or safetensors.torch.save_model")
    if all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_checkpoint(model: nn.Module, path: Path, spec: str) -> None:
    """Load a state dict into ``model``; keys or shapes that do not match raise a ValueError naming a few."""
    state = read_state_dict(path)
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or shapes:
        parts = [f"{what}: {', '.join(v[:4])}{' ...' if len(v) > 4 else ''}"
                 for what, v in (("missing", missing), ("unexpected", unexpected), ("other shapes", shapes)) if v]
        raise ValueError(f"{path} does not match {spec} ({'; '.join(parts)}): pass the checkpoint of this arch "
                         "(and its number of classes)")
    model.load_state_dict(state)


def build_skeleton(desc: dict[str, Any]) -> nn.Module:
    """The architecture :meth:`ModelSource.skeleton` describes, with initial weights, eval mode.

    Raises:
        ValueError: an unknown kind or an incomplete description.
    """
    kind = desc.get("kind")
    if kind == SourceKind.HUGGINGFACE.value:
        import transformers
        from transformers import AutoConfig

        config = dict(desc["config"])
        config_obj = AutoConfig.for_model(config.pop("model_type"), **config)
        with _HF_LOAD, quiet_transformers(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return getattr(transformers, desc["auto_class"]).from_config(
                config_obj, attn_implementation=desc.get("attn_implementation") or "sdpa", dtype=torch.float32).eval()
    if kind == SourceKind.TORCHVISION.value:
        from torchvision.models import get_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return get_model(desc["arch"], weights=None, num_classes=int(desc["num_classes"])).eval()
    if kind == SourceKind.CALLABLE.value:
        return _call_target(desc["target"]).eval()
    if kind == SourceKind.EMBEDDED.value:
        return get_entry(desc["name"]).build(pretrained=False)
    raise ValueError(f"unknown skeleton kind {kind!r}: expected one of {[k.value for k in SourceKind]}")


def _call_target(target: str) -> nn.Module:
    module, _, attr = target.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"'{target}': cannot import {attr!r} from {module!r} ({err}): check the name and that "
                         "the package is importable (on PYTHONPATH)") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = fn()
    if not isinstance(model, nn.Module):
        raise ValueError(f"'{target}' returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _callable_modality(model: nn.Module, tokenizer: str) -> Modality:
    """Text when a tokenizer is given or the model starts with an embedding, else images."""
    if tokenizer:
        return Modality.TEXT
    first = next((m for m in model.modules() if isinstance(m, (nn.Embedding, nn.Conv2d, nn.Linear))), None)
    return Modality.TEXT if isinstance(first, nn.Embedding) else Modality.IMAGE


def resolve_model(spec: str, checkpoint: str | Path = "", num_classes: int = 0, tokenizer: str | Path = "") -> ModelSource:
    """What ``spec`` names, checked (see the module docstring): a :class:`ModelSource`.

    Args:
        spec: a Hugging Face model directory, ``torchvision:<arch>``, ``package.module:function``
            or an embedded model name.
        checkpoint: weights file for torchvision / callable / embedded sources.
        num_classes: torchvision: the class count (0: read from the checkpoint).
        tokenizer: callable sources reading text: a tokenizer folder.

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: a directory that is not a model, an unknown torchvision arch, a checkpoint
            that does not fit, a callable that cannot be imported or returns no module.
    """
    spec, checkpoint, tokenizer = str(spec), str(checkpoint or ""), str(tokenizer or "")
    if spec.startswith("torchvision:"):
        from torchvision.models import list_models

        arch = spec.split(":", 1)[1]
        if arch not in list_models():
            import difflib

            close = difflib.get_close_matches(arch, list_models(), n=3)
            raise ValueError(f"torchvision has no model '{arch}'" + (f" (did you mean {', '.join(close)}?)" if close
                                                                      else "; see torchvision.models.list_models()"))
        if not checkpoint:
            raise ValueError(f"{spec} needs its weights: pass a checkpoint (a state dict, .pth or .safetensors)")
        n = int(num_classes) or _torchvision_num_classes(arch, read_state_dict(Path(checkpoint)))
        return ModelSource(spec, SourceKind.TORCHVISION, checkpoint, n, modality=Modality.IMAGE)
    if spec in known_models():
        return ModelSource(spec, SourceKind.EMBEDDED, checkpoint,
                           modality=Modality.TEXT if spec.startswith("minilm") else Modality.IMAGE)
    path = Path(spec)
    if ":" in spec and not path.exists():
        model = _call_target(spec)
        return ModelSource(spec, SourceKind.CALLABLE, checkpoint, modality=_callable_modality(model, tokenizer),
                           tokenizer=tokenizer)
    if path.is_file():
        raise ValueError(f"{spec} is a file, not a model directory: pass the folder save_pretrained wrote, or "
                         "torchvision:<arch> with this file as its checkpoint")
    config = _hf_config(path)
    auto = auto_class_for(getattr(config, "architectures", None))
    vision = getattr(config, "model_type", "") in _vision_model_types() or auto == "AutoModelForImageClassification"
    n = int(getattr(config, "num_labels", 0) or 0) if auto.endswith("SequenceClassification") or vision else 0
    return ModelSource(str(path), SourceKind.HUGGINGFACE, num_classes=n, auto_class=auto,
                       modality=Modality.IMAGE if vision else Modality.TEXT, causal_lm=auto == "AutoModelForCausalLM")


def _vision_model_types() -> set[str]:
    """Hugging Face model types whose inputs are images (the image-classification mapping's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    return set(MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)


__all__ = ["ModelSource", "SourceKind", "Modality", "resolve_model", "build_skeleton", "load_checkpoint",
           "read_state_dict", "auto_class_for", "unpacked", "quiet_transformers"]
