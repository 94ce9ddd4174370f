"""Human-rated sentiment sentences from the vaderSentiment 3.3.2 source archive.

The sdist ``vaderSentiment-3.3.2.tar.gz`` holds a nested tarball
``vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz`` whose
``hutto_ICWSM_2014/<domain>_GroundTruth.txt`` files have CRLF lines ``id<TAB>mean_rating<TAB>sentence``
(mean of ~20 human ratings on a -4..4 scale). Both tarballs are read in memory.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import torch
from torch import Tensor

DOMAIN_FILES = {
    "movie": "movieReviewSnippets_GroundTruth.txt",
    "tweets": "tweets_GroundTruth.txt",
    "amazon": "amazonReviewSnippets_GroundTruth.txt",
    "nyt": "nytEditorialSnippets_GroundTruth.txt",
}

INNER_ARCHIVE = "additional_resources/hutto_ICWSM_2014.tar.gz"
INNER_DIR = "hutto_ICWSM_2014"

_HOW_TO_GET = (
    "get it with `pip download --no-deps --no-binary :all: vaderSentiment==3.3.2` "
    "(saves vaderSentiment-3.3.2.tar.gz in the current directory)"
)


def decode_line(raw: bytes) -> str:
    """Decode one line as UTF-8, falling back to cp1252 then latin-1; strip CR/LF.

    Args:
        raw: the bytes of one line (with or without its ``\\r\\n``).

    Returns:
        The decoded line without trailing ``\\r``/``\\n``.
    """
    raw = raw.rstrip(b"\r\n")
    for encoding in ("utf-8", "cp1252"):
        try:
            return raw.decode(encoding)
        except UnicodeDecodeError:
            continue
    return raw.decode("latin-1")  # never fails: every byte is a code point


def _member(tar: tarfile.TarFile, suffix: str, where: Path | str) -> bytes:
    """Bytes of the only regular member whose name ends with ``suffix``."""
    for member in tar.getmembers():
        if member.isfile() and member.name.endswith(suffix):
            fh = tar.extractfile(member)
            if fh is not None:
                return fh.read()
    raise ValueError(f"{where}: no member ending with '{suffix}'")


def parse_ground_truth(text: bytes, source: str = "<bytes>") -> list[tuple[str, float]]:
    """Parse a ``*_GroundTruth.txt`` payload into ``(sentence, mean_rating)`` pairs.

    Blank lines are skipped; a line without three tab-separated fields or with a
    non-numeric rating raises ValueError naming ``source`` and the line number.
    """
    records: list[tuple[str, float]] = []
    for lineno, raw in enumerate(text.split(b"\n"), start=1):
        line = decode_line(raw)
        if not line.strip():
            continue
        parts = line.split("\t", 2)
        if len(parts) != 3:
            raise ValueError(f"{source}:{lineno}: expected 'id<TAB>rating<TAB>sentence', got {line!r}")
        try:
            rating = float(parts[1])
        except ValueError as err:
            raise ValueError(f"{source}:{lineno}: rating {parts[1]!r} is not a number") from err
        records.append((parts[2].strip(), rating))
    return records


def load_vader_domain(archive: Path, domain: str) -> list[tuple[str, float]]:
    """Read one domain's ground-truth sentences from the vaderSentiment sdist.

    Args:
        archive: path of ``vaderSentiment-3.3.2.tar.gz``.
        domain: one of ``'movie'``, ``'tweets'``, ``'amazon'``, ``'nyt'``.

    Returns:
        ``[(sentence, mean_rating), ...]`` in file order (movie: 10605 sentences).

    Raises:
        ValueError: unknown domain (lists the valid ones) or malformed archive/file.
        FileNotFoundError: the archive is missing (says how to get it).
    """
    if domain not in DOMAIN_FILES:
        raise ValueError(f"unknown vader domain {domain!r}; valid domains: {', '.join(DOMAIN_FILES)}")
    archive = Path(archive)
    if not archive.is_file():
        raise FileNotFoundError(f"vaderSentiment archive {archive} not found; {_HOW_TO_GET}")
    try:
        with tarfile.open(archive, "r:*") as outer:
            inner_bytes = _member(outer, INNER_ARCHIVE, archive)
        with tarfile.open(fileobj=io.BytesIO(inner_bytes), mode="r:*") as inner:
            payload = _member(inner, f"{INNER_DIR}/{DOMAIN_FILES[domain]}", INNER_ARCHIVE)
    except (tarfile.TarError, EOFError, OSError) as err:
        raise ValueError(f"{archive}: cannot read archive ({err})") from err
    return parse_ground_truth(payload, f"{archive}!{DOMAIN_FILES[domain]}")


def binary_labels(records: list[tuple[str, float]]) -> tuple[list[str], Tensor]:
    """Turn mean ratings into binary sentiment labels by sign.

    Args:
        records: ``(sentence, mean_rating)`` pairs.

    Returns:
        ``(sentences, labels)``: labels int64 (M,), 1 for rating > 0 and 0 for rating < 0;
        records with rating == 0 are dropped (M <= len(records)).
    """
    sentences = [s for s, r in records if r != 0]
    labels = torch.tensor([1 if r > 0 else 0 for _, r in records if r != 0], dtype=torch.int64)
    return sentences, labels


def split_indices(n: int, test_fraction: float, seed: int) -> tuple[Tensor, Tensor]:
    """Seeded random train/test split of ``range(n)``.

    Args:
        n: number of items (>= 2).
        test_fraction: fraction in (0, 1) that goes to test; the test size is
            ``round(n * test_fraction)`` clipped to ``[1, n - 1]``.
        seed: seed of the ``torch.Generator`` drawing the permutation.

    Returns:
        ``(train_idx, test_idx)``: disjoint int64 tensors covering ``range(n)``, each in
        permutation order (identical for identical arguments on any machine).
    """
    if n < 2:
        raise ValueError(f"split_indices: need n >= 2 items to split, got {n}")
    if not 0 < test_fraction < 1:
        raise ValueError(f"split_indices: test_fraction = {test_fraction} must be in (0, 1)")
    n_test = min(max(int(round(n * test_fraction)), 1), n - 1)
    perm = seeded_permutation(n, seed)
    return perm[n_test:], perm[:n_test]


def seeded_permutation(n: int, seed: int) -> Tensor:
    """``torch.randperm(n)`` (int64) from a fresh CPU generator seeded with ``seed``."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    return torch.randperm(n, generator=gen, dtype=torch.int64)
