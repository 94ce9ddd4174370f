"""bayesq.harness.data.files: every supported format read through datasets, disjoint seeded
draws, preprocessing from the model's own files, and every bad input named."""

import pytest
import torch

from bayesq.harness.data.files import (
    DataSource,
    check_columns,
    DEFAULT_SIZES,
    MIN_SIZES,
    DrawSizes,
    draw_examples,
    featurizer,
    fit_draw_sizes,
    load_rows,
    make_batches,
    read_labels,
)
from bayesq.harness.sources import resolve_model, unpacked


@pytest.mark.parametrize("fmt", ["parquet", "csv", "jsonl", "disk"])
def test_load_rows_reads_every_text_format_alike(byo_data, fmt):
    ds = load_rows(DataSource(str(byo_data[fmt]), text_columns=("sentence",), label_column="label"))
    ref = load_rows(DataSource(str(byo_data["parquet"])))
    assert len(ds) == len(ref) == 200
    assert ds["sentence"] == ref["sentence"] and ds["label"] == ref["label"]


def test_load_rows_split_and_image_folder(byo_data):
    assert len(load_rows(DataSource(str(byo_data["disk"]), split="test"))) == 40
    with pytest.raises(ValueError, match="has no split 'validation'; its splits: train, test"):
        load_rows(DataSource(str(byo_data["disk"]), split="validation"))
    images = load_rows(DataSource(str(byo_data["images"]), label_column="label"))
    assert len(images) == 72 and set(images.column_names) == {"image", "label"}
    assert sorted(set(images["label"])) == [0, 1, 2]


def test_draw_examples_disjoint_seeded_and_sized():
    d = draw_examples(100, 20, 30, 40, seed=3)
    parts = [d.calibration, d.selection, d.test]
    assert [len(p) for p in parts] == [20, 30, 40]
    assert len(set(torch.cat(parts).tolist())) == 90  # disjoint
    assert all(bool((p[1:] > p[:-1]).all()) for p in parts)  # sorted
    again = draw_examples(100, 20, 30, 40, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(parts, [again.calibration, again.selection, again.test]))
    assert not torch.equal(draw_examples(100, 20, 30, 40, seed=4).calibration, d.calibration)
    assert torch.equal(draw_examples(100, 50, 10, 40, seed=3).test, d.test)  # the test draw: seed and size only
    assert d.digest("test") == again.digest("test") != d.digest("calibration")
    with pytest.raises(ValueError, match=r"has 50 examples but calibration \+ selection \+ test need 20 \+ 30 \+ 40 = 90"):
        draw_examples(50, 20, 30, 40, seed=0)


def test_fit_draw_sizes_defaults_shrink_together_to_fit():
    sizes = fit_draw_sizes(1280)  # exactly the defaults: nothing shrunk
    assert fit_draw_sizes(5000) == sizes and sizes.note == ""
    assert (sizes.calibration, sizes.selection, sizes.test) == (512, 256, 512) == tuple(DEFAULT_SIZES.values())
    small = fit_draw_sizes(600)  # the defaults scaled by 600 / 1280
    assert (small.calibration, small.selection, small.test) == (240, 120, 240)
    assert "the data has 600 examples" in small.note and "scaled by 0.47" in small.note
    given = fit_draw_sizes(600, calibration=400)  # kept; the others share the rest
    assert (given.calibration, given.selection, given.test) == (400, 66, 133) and "plus the sizes given" in given.note
    assert fit_draw_sizes(100, 20, 30, 40) == DrawSizes(20, 30, 40, "")
    assert fit_draw_sizes(50, 20, 30, 40).calibration == 20  # every size given: never shrunk (draw_examples refuses)
    with pytest.raises(ValueError, match=r"has 300 examples but the sizes given need calibration 250 \+ test 100 = 350"):
        fit_draw_sizes(300, calibration=250, test=100)
    with pytest.raises(ValueError, match="selection = -1"):
        fit_draw_sizes(300, selection=-1)


def test_fit_draw_sizes_floor_names_the_fewest_examples_vs_brute_force():
    """The error below the floor names the smallest data size the defaults run on, found here by
    trying every size."""
    for given in ({}, {"calibration": 100}, {"test": 30, "selection": 0}):
        def runs(n: int) -> bool:
            try:
                fit_draw_sizes(n, **given)
                return True
            except ValueError:
                return False

        least = next(n for n in range(1, 2000) if runs(n))
        assert all(runs(n) for n in range(least, least + 300))
        with pytest.raises(ValueError, match=rf"below the \d+ that measurement supports .* bring at least {least} examples"):
            fit_draw_sizes(least - 1, **given)
        sizes = fit_draw_sizes(least, **given)
        assert all(getattr(sizes, k) >= MIN_SIZES[k] for k in MIN_SIZES if k not in given)


def test_bad_columns_and_kinds_are_named(byo_data, tmp_path):
    import datasets

    ds = load_rows(DataSource(str(byo_data["parquet"])))
    with pytest.raises(ValueError, match=r"text column 'sentense' is not in .*did you mean 'sentence'.*columns: "
                                         r"sentence, second, label"):
        check_columns(ds, DataSource(str(byo_data["parquet"]), text_columns=("sentense",)), "text")
    with pytest.raises(ValueError, match="label column 'y' is not in"):
        check_columns(ds, DataSource(str(byo_data["parquet"]), text_columns=("sentence",), label_column="y"), "text")
    with pytest.raises(ValueError, match="given to an image model"):
        check_columns(ds, DataSource(str(byo_data["parquet"]), text_columns=("sentence",)), "image")
    with pytest.raises(ValueError, match="the model reads text: pass --text-column"):
        check_columns(ds, DataSource(str(byo_data["parquet"])), "text")
    empty = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"sentence": [], "label": []}).to_parquet(str(empty))
    with pytest.raises(ValueError, match="has no examples"):
        check_columns(load_rows(DataSource(str(empty))), DataSource(str(empty), text_columns=("sentence",)), "text")
    with pytest.raises(FileNotFoundError, match="no data at"):
        load_rows(DataSource(str(tmp_path / "absent.parquet")))
    (tmp_path / "x.txt").write_text("a")
    with pytest.raises(ValueError, match="cannot read '.txt' files"):
        load_rows(DataSource(str(tmp_path / "x.txt")))
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="neither a save_to_disk folder"):
        load_rows(DataSource(str(tmp_path / "folder")))
    with pytest.raises(ValueError, match="one column, or two"):
        DataSource("x", text_columns=("a", "b", "c"))


def test_read_labels_range_and_class_names(byo_data, tmp_path):
    import datasets

    src = DataSource(str(byo_data["parquet"]), text_columns=("sentence",), label_column="label")
    ds = load_rows(src)
    idx = torch.arange(10)
    assert read_labels(ds, idx, src, 2).tolist() == [i % 2 for i in range(10)]
    assert read_labels(ds, idx, DataSource(src.path, text_columns=("sentence",)), 2) is None
    with pytest.raises(ValueError, match=r"labels outside the head's classes: column 'label' holds \[1\] but the "
                                         r"model has 1 classes"):
        read_labels(ds, idx, src, 1)
    named = tmp_path / "named.csv"
    datasets.Dataset.from_dict({"s": ["a", "b"], "y": ["pos", "neg"]}).to_csv(str(named), index=False)
    nsrc = DataSource(str(named), text_columns=("s",), label_column="y")
    assert read_labels(load_rows(nsrc), torch.arange(2), nsrc, 2, {"neg": 0, "pos": 1}).tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"class names \['neg', 'pos'\] the model does not know"):
        read_labels(load_rows(nsrc), torch.arange(2), nsrc, 2, None)


def test_featurizer_from_the_model_files(byo_models, byo_data):
    from transformers import AutoTokenizer

    pair = DataSource(str(byo_data["parquet"]), text_columns=("sentence", "second"), max_length=9)
    ds = load_rows(pair)
    src = resolve_model(str(byo_models["bert"]))
    pre = src.preprocessor()
    with unpacked(pre["files"]) as folder:
        (batch,) = make_batches(ds, torch.arange(5), featurizer(pre, pair, folder), 8)
    want = AutoTokenizer.from_pretrained(str(byo_models["bert"]))(ds["sentence"][:5], ds["second"][:5],
                                                                  padding="longest", truncation=True, max_length=9,
                                                                  return_tensors="pt")
    assert torch.equal(batch["input_ids"], want["input_ids"]) and batch["input_ids"].shape[1] <= 9
    assert torch.equal(batch["token_type_ids"], want["token_type_ids"])  # sentence pairs
    images = DataSource(str(byo_data["images"]), label_column="label", image_size=32)
    ids = load_rows(images)
    tv = resolve_model("torchvision:mobilenet_v3_small", byo_models["mnv3"]).preprocessor(32)
    batches = make_batches(ids, torch.arange(10), featurizer(tv, images), 4)
    assert [b.shape for b in batches] == [(4, 3, 32, 32), (4, 3, 32, 32), (2, 3, 32, 32)]
    vit = resolve_model(str(byo_models["vit"])).preprocessor()
    with unpacked(vit["files"]) as folder:
        (b,) = make_batches(ids, torch.arange(3), featurizer(vit, images, folder), 4)
    assert b["pixel_values"].shape == (3, 3, 32, 32)
