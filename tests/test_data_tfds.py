"""TFDS-backed datasets, without network or prepared data.

Three sources stand in for the real datasets:
* ``tfds.testing.mock_data``: random records through tfds' own ``ArrayRecordDataSource``
  wrapper (images), or hand-written records via ``as_data_source_fn`` (IMDb);
* a real array_record copy prepared on the fly from a few generated records (the
  builders' download step is replaced), read through the unmocked path;
* an empty data directory, for the not-prepared error.
"""

import functools
import io
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import tensorflow_datasets as tfds
from PIL import Image

from pdasgd_jax import data
from pdasgd_jax.data import text, tfds_loader
from pdasgd_jax.data.text import PAD, UNK

IMAGE_SHAPES = {"mnist": ((28, 28, 1), 10), "cifar10": ((32, 32, 3), 10), "cifar100": ((32, 32, 3), 100)}
MEAN_STD = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}


class _BatchReadingSourceMock(tfds.testing.PickableDataSourceMock):
    """The mocked ArrayRecord reader with a working ``__getitems__``.

    tfds 4.9.10's ``mock_data`` assigns ``__getitems__`` as a plain attribute, so it is called
    without ``self`` and fails; ``mock`` only binds the magic methods it knows. Binding it
    here lets the loader's batched read run against the mock.
    """

    def __setattr__(self, name, value):
        if name == "__getitems__":
            value = functools.partial(value, self)
        super().__setattr__(name, value)


def mock_tfds(num_examples):
    return tfds.testing.mock_data(
        num_examples=num_examples,
        policy=tfds.testing.MockPolicy.USE_CODE,
        mock_array_record_data_source=_BatchReadingSourceMock(),
    )


def mock_imdb(train, test):
    """Serves the given (text, label) records as IMDb's train and test splits."""
    records = {split: [{"text": t, "label": y} for t, y in rows] for split, rows in (("train", train), ("test", test))}

    def as_data_source(builder, split, **kwargs):
        return [records[s] for s in split]

    return tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE, as_data_source_fn=as_data_source)


# The checks that need a fresh interpreter share one launch (each pays JAX's import): what
# importing the data package imports, then (TFDS reads TFDS_DATA_DIR at import) loading with
# ``data_dir=None`` from an empty TFDS_DATA_DIR.
_FRESH = """
import sys, pdasgd_jax.data as d
print("tfds imported:", "tensorflow_datasets" in sys.modules)
try: d.load_dataset("mnist")
except d.DatasetNotPreparedError as e: print(e)
"""


@pytest.fixture(scope="module")
def fresh_interpreter(tmp_path_factory):
    """``(the empty TFDS_DATA_DIR, the fresh interpreter's output)``."""
    data_dir = tmp_path_factory.mktemp("tfds_data_dir")
    env = {**os.environ, "TFDS_DATA_DIR": str(data_dir)}
    done = subprocess.run([sys.executable, "-c", _FRESH], env=env, check=True, capture_output=True, text=True)
    return data_dir, done.stdout


def test_importing_the_data_package_does_not_import_tfds(fresh_interpreter):
    _, out = fresh_interpreter
    assert out.splitlines()[0] == "tfds imported: False"


# --- images --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(IMAGE_SHAPES))
def test_mocked_images_are_normalised_float32_with_int32_labels(name, tmp_path):
    shape, num_classes = IMAGE_SHAPES[name]
    with mock_tfds(num_examples=20):
        ds = data.load_dataset(name, data_dir=str(tmp_path))
    assert (ds.name, ds.modality, ds.num_classes, ds.vocab_size) == (name, "image", num_classes, None)
    assert (len(ds.train), len(ds.test)) == (20, 20)
    assert ds.input_shape == shape
    idx = np.arange(20)
    x, y = ds.train.take(idx)
    assert x.shape == (20, *shape) and x.dtype == np.float32
    assert y.dtype == np.int32 and ((y >= 0) & (y < num_classes)).all()
    mean, std = (np.array(v, np.float32) for v in MEAN_STD[name])
    assert (x >= -mean / std - 1e-6).all() and (x <= (1 - mean) / std + 1e-6).all()
    raw = np.stack([ds.train.source[int(i)]["image"] for i in idx])
    np.testing.assert_allclose(x, (raw / 255.0 - mean) / std, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(y, [ds.train.source[int(i)]["label"] for i in idx])


def test_batched_and_per_index_reads_agree(tmp_path):
    with mock_tfds(num_examples=10):
        ds = data.load_dataset("cifar10", data_dir=str(tmp_path))
    per_index = tfds_loader.SourceSplit([ds.train.source[i] for i in range(10)], ds.train.decode)
    idx = np.array([7, 2, 9])
    for got, want in zip(ds.train.take(idx), per_index.take(idx)):
        np.testing.assert_array_equal(got, want)


def test_train_batches_are_deterministic_for_a_seed(tmp_path):
    with mock_tfds(num_examples=40):
        a = data.load_dataset("mnist", data_dir=str(tmp_path))
        b = data.load_dataset("mnist", data_dir=str(tmp_path))
    run = lambda ds, seed: list(data.train_batches(ds.train, 8, seed=seed, epoch=0))
    first, again, other = run(a, 1), run(b, 1), run(a, 2)
    assert len(first) == 5 and first[0][0].shape == (8, 28, 28, 1)
    for (x1, y1), (x2, y2) in zip(first, again):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    assert not all(np.array_equal(x1, x2) for (x1, _), (x2, _) in zip(first, other))


# --- text ----------------------------------------------------------------------------------


def test_tokenize_lowercases_and_drops_markup_and_punctuation():
    assert text.tokenize(b"Great FILM!<br /><br />I don't regret it.") == [
        "great",
        "film",
        "i",
        "don't",
        "regret",
        "it",
    ]
    assert text.tokenize("end.<BR>Start -- 10/10") == ["end", "start", "10", "10"]


def test_vocabulary_ranks_by_frequency_then_word_and_caps_size():
    corpus = ["b a c", "a b d", "c e"]  # a, b, c twice; d, e once
    vocab = text.Vocabulary.build(corpus, size=5)
    assert vocab.words == ("<pad>", "<unk>", "a", "b", "c")
    assert text.Vocabulary.build(reversed(corpus), size=5).words == vocab.words
    assert len(text.Vocabulary.build(corpus, size=100)) == 7
    with pytest.raises(ValueError, match="at least 3"):
        text.Vocabulary.build(corpus, size=2)


def test_vocabulary_encode_pads_truncates_and_marks_unknown_words():
    vocab = text.Vocabulary(["a", "b"])
    ids = vocab.encode(["a b zzz", "b a b a b a"], length=4)
    assert ids.dtype == np.int32
    np.testing.assert_array_equal(ids, [[2, 3, UNK, PAD], [3, 2, 3, 2]])


IMDB_TRAIN = [(b"A great movie.<br />Great cast, great music!", 1), (b"A bad movie, bad plot.", 0), (b"Great fun", 1)]
IMDB_TEST = [(b"An awful movie; awful, awful acting.", 0), (b"Great", 1)]


def test_imdb_vocabulary_comes_from_train_only(tmp_path):
    with mock_imdb(IMDB_TRAIN, IMDB_TEST):
        ds = data.load_dataset("imdb_reviews", data_dir=str(tmp_path))
    assert (ds.modality, ds.num_classes, ds.input_shape) == ("text", 2, (tfds_loader.IMDB_LENGTH,))
    # Train counts: great 4; a, bad, movie 2; cast, fun, music, plot 1 (ties in word order).
    assert ds.vocab_size == 2 + 8
    x, y = ds.test.take(np.arange(2))
    assert x.dtype == np.int32 and y.dtype == np.int32
    np.testing.assert_array_equal(y, [0, 1])
    great, movie = 2, 5
    np.testing.assert_array_equal(x[0, :6], [UNK, UNK, movie, UNK, UNK, UNK])  # "an", "awful", "acting" unseen in train
    np.testing.assert_array_equal(x[1, :2], [great, PAD])
    assert (x[:, 6:] == PAD).all()


def test_imdb_truncates_pads_and_is_deterministic(tmp_path):
    with mock_imdb(IMDB_TRAIN, IMDB_TEST):
        short = tfds_loader.load_imdb_reviews(data_dir=str(tmp_path), vocab_size=4, length=3)
        again = tfds_loader.load_imdb_reviews(data_dir=str(tmp_path), vocab_size=4, length=3)
    x, _ = short.train.take(np.arange(3))
    great, a = 2, 3  # the only words kept
    assert short.vocab_size == 4 and short.input_shape == (3,)
    np.testing.assert_array_equal(x, [[a, great, UNK], [a, UNK, UNK], [great, UNK, PAD]])
    np.testing.assert_array_equal(again.train.take(np.arange(3))[0], x)


# --- a real array_record copy --------------------------------------------------------------


def _png(image):
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="png")
    return buf.getvalue()


def _cifar10_records(self, dl_manager):
    # Each image is constant, at a level set by its label, so decoded values can be checked.
    def split(prefix, n):
        for i in range(n):
            image = np.full((32, 32, 3), 25 * (i % 10), np.uint8)
            yield i, {"id": f"{prefix}{i:05d}", "image": _png(image), "label": i % 10}

    return {"train": split("train_", 12), "test": split("test_", 4)}


def _imdb_records(self, dl_manager):
    def split(rows):
        for i, (t, y) in enumerate(rows):
            yield str(i), {"text": t, "label": y}

    return {"train": split(IMDB_TRAIN), "test": split(IMDB_TEST)}


def _prepare(name, data_dir, generators):
    """Prepares ``name`` as array_record, the way the not-prepared message says, with local records."""
    builder_cls = type(tfds.builder(name, data_dir=data_dir))
    with mock.patch.object(builder_cls, "_split_generators", generators):
        tfds.data_source(name, data_dir=data_dir, builder_kwargs={"file_format": "array_record"}, download=True)


def test_reads_a_prepared_array_record_copy(tmp_path):
    _prepare("cifar10", str(tmp_path), _cifar10_records)
    _prepare("imdb_reviews", str(tmp_path), _imdb_records)
    images = data.load_dataset("cifar10", data_dir=str(tmp_path))
    assert (len(images.train), len(images.test), images.input_shape) == (12, 4, (32, 32, 3))
    x, y = images.train.take(np.arange(12))
    assert x.dtype == np.float32 and y.dtype == np.int32
    mean, std = (np.array(v, np.float32) for v in MEAN_STD["cifar10"])
    want = (25 * y[:, None, None, None] / 255.0 - mean) / std
    np.testing.assert_allclose(x, np.broadcast_to(want, x.shape), rtol=1e-6, atol=1e-6)
    reviews = data.load_dataset("imdb_reviews", data_dir=str(tmp_path))
    assert reviews.vocab_size == 10 and len(reviews.test) == 2


# --- not prepared --------------------------------------------------------------------------


@pytest.mark.parametrize("name", data.TFDS_DATASETS)
def test_missing_dataset_fails_with_how_to_prepare(name, tmp_path):
    with pytest.raises(data.DatasetNotPreparedError) as info:
        tfds_loader.load_tfds(name, data_dir=str(tmp_path))
    message = str(info.value)
    assert repr(name) in message and str(tmp_path) in message and "download=True" in message
    assert isinstance(info.value, RuntimeError)
    assert not any(tmp_path.iterdir())  # nothing was fetched or written


def test_load_dataset_raises_not_prepared_for_an_empty_data_dir(tmp_path):
    with pytest.raises(data.DatasetNotPreparedError, match="cifar10"):
        data.load_dataset("cifar10", data_dir=str(tmp_path))


def test_default_data_dir_missing_dataset_fails_too(fresh_interpreter):
    # data_dir=None takes another tfds path (array_record assumed, so a different error
    # inside tfds), read from TFDS_DATA_DIR at tfds' import: see ``fresh_interpreter``.
    data_dir, out = fresh_interpreter
    assert f"'mnist' is not prepared in data directory {data_dir}" in out
