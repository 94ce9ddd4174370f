"""bayesq.harness.models.glue (and bayesq.harness.models.real.register_real) on tiny checkpoints and data made in
tmp_path (no network, no real files)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bayesq.metrics import f1_binary
from bayesq.harness.models import zoo
from bayesq.harness.models.config import DataConfig
from bayesq.harness.models.glue import BertGLUE, predictions, read_glue_tsv
from bayesq.harness.models.real import register_real
from bayesq.harness.models.zoo import evaluate, get_entry

ROOT = Path(__file__).resolve().parent.parent
DATA = DataConfig(image_size=32, image_train_subset=1000, image_test_subset=1000,
                  text_train_subset=1000, text_test_subset=1000, split_seed=0)


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def _same_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    got = model.state_dict()
    return got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)


# --------------------------------------------------------------------------- GLUE fixtures

MNLI_TRAIN_HEAD = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
                   "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label")
MNLI_DEV_HEAD = MNLI_TRAIN_HEAD.replace("label1", "label1\tlabel2\tlabel3\tlabel4\tlabel5")
MNLI_LABELS = ["entailment", "neutral", "contradiction", "neutral"]
PAIRS = [("what is good", "the movie is good"), ('a "bad" movie', "why bad"),
         ("the movie", "what the movie is"), ("is it good", "it is")]


def _mnli(rows, dev: bool) -> str:
    lines = [MNLI_DEV_HEAD if dev else MNLI_TRAIN_HEAD]
    for i, ((a, b), lab) in enumerate(zip(rows, MNLI_LABELS)):
        labels = [lab] * (5 if dev else 1)
        lines.append("\t".join([str(i), "1", f"{i}e", "fiction", "( x )", "( y )", "(ROOT x)", "(ROOT y)",
                                a, b, *labels, lab]))
    return "\n".join(lines) + "\n"


def _write_glue(root: Path) -> None:
    files = {
        "SST-2/train.tsv": "sentence\tlabel\nthe movie is good \t1\na \"bad\" movie\t0\nwhy\t0\n",
        "SST-2/dev.tsv": "sentence\tlabel\ngood good\t1\nbad\t0\n",
        "QNLI/train.tsv": "index\tquestion\tsentence\tlabel\n"
                          "0\twhat is good\tthe movie is good\tentailment\n"
                          "1\twhy bad\tthe movie\tnot_entailment\n",
        "QNLI/dev.tsv": "index\tquestion\tsentence\tlabel\n0\tis it good\tit is good\tentailment\n"
                        "1\twhat\tbad\tnot_entailment\n2\tis it bad\tit is\tnot_entailment\n",
        "QQP/train.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                         "0\t1\t2\twhat is good\twhat is good movie\t1\n"
                         "1\t3\t4\twhy bad\n"  # malformed: question2 and label on the next line
                         "the movie\t0\n"
                         "2\t5\t6\tis it bad\tis the movie bad\t0\n",
        "QQP/dev.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
                       "0\t1\t2\twhat is good\tis it good\t1\n1\t3\t4\twhy\tthe movie is bad\t0\n"
                       "2\t5\t6\tgood\tgood\t1\n3\t7\t8\tbad movie\tis it\t0\n",
        "MNLI/train.tsv": _mnli(PAIRS, dev=False),
        "MNLI/dev_matched.tsv": _mnli(PAIRS[:3], dev=True),
        "MNLI/dev_mismatched.tsv": _mnli(PAIRS[1:], dev=True),
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")


@pytest.fixture(scope="module")
def glue_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("glue")
    _write_glue(root)
    return root


VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "movie", "is", "good", "bad", "what",
         "why", "it", "a", '"']


def _tiny_bert_dir(folder: Path, num_labels: int) -> dict[str, torch.Tensor]:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    torch.manual_seed(11 + num_labels)
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64, num_labels=num_labels)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)}).save_pretrained(folder)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def berts(tmp_path_factory) -> dict[int, tuple[Path, dict[str, torch.Tensor]]]:
    base = tmp_path_factory.mktemp("bert")
    return {n: (base / f"l{n}", _tiny_bert_dir(base / f"l{n}", n)) for n in (2, 3)}


EXPECTED = {  # (train inputs -> label, dev inputs -> label), HF GLUE label ids
    "sst2": ({"the movie is good ": 1, 'a "bad" movie': 0, "why": 0}, {"good good": 1, "bad": 0}),
    "qnli": ({("what is good", "the movie is good"): 0, ("why bad", "the movie"): 1},
             {("is it good", "it is good"): 0, ("what", "bad"): 1, ("is it bad", "it is"): 1}),
    "qqp": ({("what is good", "what is good movie"): 1, ("is it bad", "is the movie bad"): 0},
            {("what is good", "is it good"): 1, ("why", "the movie is bad"): 0, ("good", "good"): 1,
             ("bad movie", "is it"): 0}),
    "mnli-m": (dict(zip(PAIRS, [0, 1, 2, 1])), dict(zip(PAIRS[:3], [0, 1, 2]))),
    "mnli-mm": (dict(zip(PAIRS, [0, 1, 2, 1])), dict(zip(PAIRS[1:], [0, 1, 2]))),
}


# --------------------------------------------------------------------------- GLUE data


@pytest.mark.parametrize("task", list(EXPECTED))
def test_glue_reader_maps_labels(task, glue_dir):
    entry = BertGLUE("unused", glue_dir, task)
    s = entry.load_splits(DATA, glue_dir)
    train, dev = EXPECTED[task]
    assert dict(zip(s.train_inputs, s.train_labels.tolist())) == train and len(s.train_inputs) == len(train)
    assert dict(zip(s.test_inputs, s.test_labels.tolist())) == dev and len(s.test_inputs) == len(dev)
    assert s.train_labels.dtype == s.test_labels.dtype == torch.int64
    lengths = [len(x) if isinstance(x, str) else len(x[0]) + len(x[1]) for x in s.test_inputs]
    assert lengths == sorted(lengths)
    capped = entry.load_splits(DataConfig(text_train_subset=1, text_test_subset=2), glue_dir)
    assert len(capped.train_inputs) == 1 and len(capped.test_inputs) == 2


def test_qqp_malformed_row_is_skipped_and_counted(glue_dir):
    inputs, labels, skipped = read_glue_tsv(glue_dir / "QQP/train.tsv", ("question1", "question2"),
                                            "is_duplicate", ("0", "1"))
    assert skipped == 2 and len(inputs) == 2 and labels.tolist() == [1, 0]
    entry = BertGLUE("unused", glue_dir, "qqp")
    entry.load_splits(DATA, glue_dir)
    assert entry.skipped_rows == {str(glue_dir / "QQP/train.tsv"): 2, str(glue_dir / "QQP/dev.tsv"): 0}


def test_glue_errors(glue_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown GLUE task 'cola'; choices: mnli-m, mnli-mm, qnli, qqp, sst2"):
        BertGLUE("unused", glue_dir, "cola")
    with pytest.raises(FileNotFoundError, match="expected " + re.escape(str(tmp_path / "MNLI" / "train.tsv"))):
        BertGLUE("unused", tmp_path, "mnli-mm").load_splits(DATA, tmp_path)
    (tmp_path / "SST-2").mkdir()
    (tmp_path / "SST-2" / "train.tsv").write_text("sentence\tlabel\ngood\t1\nmeh\tmaybe\n")
    with pytest.raises(ValueError, match=r"train.tsv, line 3: label 'maybe' .* not one of \['0', '1'\]"):
        BertGLUE("unused", tmp_path, "sst2").load_splits(DATA, tmp_path)
    (tmp_path / "QNLI").mkdir()
    (tmp_path / "QNLI" / "train.tsv").write_text("index\tquestion\tlabel\n0\twhy\tentailment\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) \['sentence'\]"):
        BertGLUE("unused", tmp_path, "qnli").load_splits(DATA, tmp_path)


# --------------------------------------------------------------------------- tiny BERT


def test_bert_build_loads_exactly_the_saved_weights(berts, glue_dir):
    path, state = berts[3]
    entry = BertGLUE(path, glue_dir, "mnli-m")
    model = entry.build()
    assert _same_state(model, state) and not model.training
    fresh = entry.build(pretrained=False)
    assert not _same_state(fresh, state)
    assert _same_state(entry.build(pretrained=False), fresh.state_dict())


def test_bert_batches_and_end_to_end_metrics(berts, glue_dir):
    entry = BertGLUE(berts[2][0], glue_dir, "qqp", max_length=9)
    s = entry.load_splits(DATA, glue_dir)
    batches = entry.batches(s.test_inputs, 3, DATA)
    assert [b["input_ids"].shape[0] for b in batches] == [3, 1]
    for b in batches:
        assert set(b) == {"input_ids", "attention_mask", "token_type_ids"}
        assert all(v.dtype == torch.int64 and v.shape == b["input_ids"].shape for v in b.values())
        assert b["input_ids"].shape[1] <= 9 and (b["token_type_ids"] == 1).any()  # second segment
    model = entry.build()
    acc = evaluate(model, batches, s.test_labels)
    pred = predictions(model, batches)
    assert entry.metrics(model, batches, s.test_labels) == pytest.approx(
        {"f1": f1_binary(pred, s.test_labels), "accuracy": acc})
    sst = BertGLUE(berts[2][0], glue_dir, "sst2")
    (single,) = sst.batches(sst.load_splits(DATA, glue_dir).test_inputs, 8, DATA)
    assert single["input_ids"].shape[0] == 2 and not single["token_type_ids"].any()
    assert 0.0 <= evaluate(sst.build(), [single], sst.load_splits(DATA, glue_dir).test_labels) <= 1.0


def test_bert_base_checkpoint_gets_a_new_head(berts, glue_dir, tmp_path, caplog):
    from transformers import BertConfig, BertModel

    torch.manual_seed(5)
    base = BertModel(BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=37, max_position_embeddings=64))
    base.save_pretrained(tmp_path / "base")
    with caplog.at_level("WARNING", logger="bayesq.harness.models.glue"):
        model = BertGLUE(tmp_path / "base", glue_dir, "qnli").build()
    assert "no classification head" in caplog.text and model.classifier.out_features == 2
    got = model.state_dict()
    assert all(torch.equal(got[f"bert.{k}"], v) for k, v in base.state_dict().items())


def test_bert_checkpoint_errors(berts, glue_dir, tmp_path):
    from transformers import BertConfig

    with pytest.raises(ValueError, match=r"classifier with 2 labels, but GLUE mnli-m has 3"):
        BertGLUE(berts[2][0], glue_dir, "mnli-m").build()
    flipped = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         id2label={0: "contradiction", 1: "neutral", 2: "entailment"},
                         architectures=["BertForSequenceClassification"])
    flipped.save_pretrained(tmp_path / "flipped")
    with pytest.raises(ValueError, match=r"label order \['contradiction', 'neutral', 'entailment'\] differs"):
        BertGLUE(tmp_path / "flipped", glue_dir, "mnli-mm").build()
    with pytest.raises(FileNotFoundError, match="not a local checkpoint directory"):
        BertGLUE(tmp_path / "nowhere", glue_dir, "sst2").build()


# --------------------------------------------------------------------------- registration, purity


def test_register_real_makes_entries_available_by_name(berts, glue_dir, tmp_path):
    imagenet_root = tmp_path / "imagenet"  # not read: entries only keep the path
    before = zoo.known_models()
    try:
        names = register_real(imagenet_root=imagenet_root, resnet_weights="IMAGENET1K_V2",
                              glue_dir=glue_dir, bert_models={"sst2": berts[2][0], "MNLI": berts[3][0]})
        assert names == ("resnet50-imagenet", "bert-sst2", "bert-mnli-m")
        assert get_entry("bert-mnli-m").glue_task == "mnli-m"
        assert get_entry("resnet50-imagenet").default_raw == imagenet_root
        with pytest.raises(ValueError, match=r"\['bert-sst2'\] already registered"):
            register_real(glue_dir=glue_dir, bert_models={"sst2": berts[2][0]})
        assert register_real(glue_dir=glue_dir, bert_models={"sst2": berts[2][0]}, replace=True) == ("bert-sst2",)
    finally:
        for name in ("resnet50-imagenet", "bert-sst2", "bert-mnli-m"):
            zoo.unregister(name)
    with pytest.raises(ValueError, match="needs glue_dir"):
        register_real(bert_models={"sst2": "x"})
    with pytest.raises(ValueError, match="unknown GLUE task 'rte'"):
        register_real(glue_dir=glue_dir, bert_models={"sst2": "x", "rte": "y"})
    assert zoo.known_models() == before


def test_import_has_no_side_effects():
    code = ("import sys, bayesq.harness.models.real, bayesq.harness.models.imagenet, bayesq.harness.models.glue, bayesq.metrics;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('prefect', 'mlflow', 'dvc', 'transformers', 'torchvision', 'PIL')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
