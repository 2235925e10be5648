"""TFDS datasets (``mnist``, ``cifar10``, ``cifar100``, ``imdb_reviews``) read by random access.

Splits come from ``tfds.data_source`` (ArrayRecord files, no TensorFlow) with
``download=False``: this code never downloads, so a dataset that is not on disk fails at
once with ``DatasetNotPreparedError`` saying how to prepare it. Records are fetched and
decoded one batch at a time, so a split never has to fit in memory.

``tensorflow_datasets`` is imported only inside the loaders: importing ``pdasgd_jax.data``
stays cheap for runs on the offline datasets.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pdasgd_jax.data.spec import Dataset
from pdasgd_jax.data.text import Vocabulary

IMDB_VOCAB_SIZE = 20000
IMDB_LENGTH = 256
# Records per read while building the IMDb vocabulary: bounds memory, amortises reads.
_VOCAB_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class _ImageSpec:
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


# Published per-channel training-set statistics of images scaled to [0, 1]. Fixed constants,
# not recomputed, so every run and worker normalises identically without a pass over the data.
# CIFAR-10's std is the true per-pixel one (0.247, ...), not the often-copied (0.2023, ...).
_IMAGES = {
    "mnist": _ImageSpec(10, (0.1307,), (0.3081,)),
    "cifar10": _ImageSpec(10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": _ImageSpec(100, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


class DatasetNotPreparedError(RuntimeError):
    """A TFDS dataset has no random-access (array_record) copy in the data directory."""


@dataclasses.dataclass(frozen=True)
class SourceSplit:
    """A ``Split`` over a TFDS data source, decoding records one batch at a time.

    Attributes:
      source: random-access records (``len`` and ``[i]``; ``__getitems__`` if it has one).
      decode: turns a list of records into ``(x, y)`` arrays.
    """

    source: Sequence[Any]
    decode: Callable[[list[Any]], tuple[np.ndarray, np.ndarray]]

    def __len__(self) -> int:
        return len(self.source)

    def take(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.decode(_fetch(self.source, indices))


def load_tfds(name: str, *, data_dir: str | None = None) -> Dataset:
    """Loads a prepared TFDS dataset, without downloading anything.

    Args:
      name: ``mnist``, ``cifar10``, ``cifar100`` or ``imdb_reviews``.
      data_dir: the TFDS data directory; ``None`` for TFDS's default (``$TFDS_DATA_DIR``
        or ``~/tensorflow_datasets``).

    Returns:
      Images as normalised float32 (H, W, C); IMDb as int32 token ids (see
      ``load_imdb_reviews``). Labels are int32.

    Raises:
      ValueError: another name.
      DatasetNotPreparedError: the dataset is not on disk in array_record format.
    """
    if name == "imdb_reviews":
        return load_imdb_reviews(data_dir=data_dir)
    if name not in _IMAGES:
        raise ValueError(f"no TFDS loader for {name!r}; choose one of {', '.join([*_IMAGES, 'imdb_reviews'])}")
    spec = _IMAGES[name]
    decode = functools.partial(_decode_images, mean=np.float32(spec.mean), std=np.float32(spec.std))
    train, test = _open(name, data_dir)
    return Dataset(name, SourceSplit(train, decode), SourceSplit(test, decode), spec.num_classes, "image")


def load_imdb_reviews(
    *, data_dir: str | None = None, vocab_size: int = IMDB_VOCAB_SIZE, length: int = IMDB_LENGTH
) -> Dataset:
    """Loads IMDb reviews as fixed-length word ids, with a vocabulary from the train split.

    Building the vocabulary reads and tokenises the whole train split once.

    Args:
      data_dir: the TFDS data directory (see ``load_tfds``).
      vocab_size: the largest vocabulary size, PAD (0) and UNK (1) included.
      length: every review is truncated to its first ``length`` words or padded with PAD.

    Returns:
      A ``text`` dataset of ``(length,)`` int32 ids; ``vocab_size`` is the actual size.

    Raises:
      DatasetNotPreparedError: the dataset is not on disk in array_record format.
    """
    train, test = _open("imdb_reviews", data_dir)
    vocab = Vocabulary.build(_train_texts(train), vocab_size)
    decode = functools.partial(_decode_texts, vocab=vocab, length=length)
    return Dataset(
        "imdb_reviews", SourceSplit(train, decode), SourceSplit(test, decode), 2, "text", vocab_size=len(vocab)
    )


def _open(name: str, data_dir: str | None) -> tuple[Sequence[Any], Sequence[Any]]:
    """The train and test data sources, or ``DatasetNotPreparedError`` at once."""
    import tensorflow_datasets as tfds  # here, not at the top: see the module docstring

    # What tfds raises for a missing dataset depends on the file format it assumes:
    # KeyError (no splits recorded) for array_record, the default without data_dir;
    # NotImplementedError for TFRecord, which a copy prepared only as TFRecord also gives.
    try:
        train, test = tfds.data_source(name, split=["train", "test"], data_dir=data_dir, download=False)
    except (KeyError, NotImplementedError) as err:
        raise DatasetNotPreparedError(_not_prepared_message(name, data_dir)) from err
    return train, test


def _not_prepared_message(name: str, data_dir: str | None) -> str:
    import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=data_dir)
    root = str(builder.data_dir_root)
    # With a data_dir, tfds.data_source prepares TFRecord files unless told array_record.
    prepare = (
        f"import tensorflow_datasets as tfds; tfds.data_source({name!r}, data_dir={root!r}, "
        "builder_kwargs={'file_format': 'array_record'}, download=True)"
    )
    # TFDS PNG-encodes images with TensorFlow while preparing; text needs no TensorFlow.
    needs_tf = " (`pip install tensorflow` there first; reading needs no TensorFlow)" if name in _IMAGES else ""
    return (
        f"TFDS dataset {name!r} is not prepared in data directory {root}: no array_record copy in "
        f"{builder.data_dir}. Nothing is downloaded here. Prepare it once on a machine with network "
        f"access{needs_tf}:\n"
        f'  python -c "{prepare}"\n'
        f"or, with TensorFlow installed, `tfds build {name} --data_dir={root} --file_format=array_record`; "
        f"then copy {root}/{name} here, or pass data_dir / set TFDS_DATA_DIR to where it is."
    )


def _fetch(source: Sequence[Any], indices: Sequence[int]) -> list[Any]:
    keys = [int(i) for i in indices]
    # ArrayRecord sources read a whole batch in one call; plain sequences only index.
    getitems = getattr(source, "__getitems__", None)
    return list(getitems(keys)) if getitems is not None else [source[k] for k in keys]


def _train_texts(source: Sequence[Any]) -> Iterator[bytes | str]:
    for start in range(0, len(source), _VOCAB_CHUNK):
        for record in _fetch(source, range(start, min(start + _VOCAB_CHUNK, len(source)))):
            yield record["text"]


def _labels(records: list[Any]) -> np.ndarray:
    return np.asarray([r["label"] for r in records], np.int32)


def _decode_images(records: list[Any], *, mean: np.ndarray, std: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x = np.stack([r["image"] for r in records]).astype(np.float32) / np.float32(255)
    return (x - mean) / std, _labels(records)


def _decode_texts(records: list[Any], *, vocab: Vocabulary, length: int) -> tuple[np.ndarray, np.ndarray]:
    return vocab.encode([r["text"] for r in records], length), _labels(records)
