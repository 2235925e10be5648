"""The names every choice of ``Config`` allows, importable without JAX or Flax.

The command line's flags and ``Config``'s validation read these; the registries that implement
each choice (``models.MODELS``, the dataset loaders, ``optim``'s merges and staleness rules,
``schedules``) take their names from here or are checked against them by a test, so the two
cannot drift apart.
"""

OFFLINE_DATASETS = ("digits", "mnist1d", "mnist1d-large", "mnist1d-tokens")
TFDS_DATASETS = ("mnist", "cifar10", "cifar100", "imdb_reviews")
DATASETS = OFFLINE_DATASETS + TFDS_DATASETS
MODEL_NAMES = ("mlp", "cnn1d", "cnn", "resnet18", "resnet1d", "lstm")
AUGMENTATIONS = ("none", "crop-flip")
MERGES = ("correct", "overwrite")
STALENESS_RULES = ("none", "staleness-aware", "delay-compensated")
LR_SCHEDULES = ("constant", "cosine", "step")
