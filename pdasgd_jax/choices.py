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
# How DaSGD merges an average (optim.AveragingRule): "eager" keeps the worker's own 1/W share of
# its progress since the snapshot and passes the rest on to the next average (arXiv:2502.12996).
MERGES = ("correct", "overwrite", "eager")
STALENESS_RULES = ("none", "staleness-aware", "delay-compensated")
LR_SCHEDULES = ("constant", "cosine", "step")
ALGORITHMS = ("sgd", "sync", "asgd", "pdasgd", "pdasgd-block", "local", "dasgd", "lpp", "async-local")
# Those that run as independent worker threads (or simulated workers) updating a shared store
# (lpp: one store per device, averaged in place).
ASYNCHRONOUS = ("asgd", "pdasgd", "pdasgd-block", "lpp")
OPTIMIZERS = ("sgd", "momentum", "adamw")
DELAY_MODELS = ("none", "constant", "uniform", "exponential", "lognormal", "straggler")
# What one injected delay draw covers (docs/algorithms.md §5): each worker's part of a job
# (the default), or a whole job, split over the workers of a PD-ASGD job by their compute.
DELAY_PER = ("operation", "job")
BACKWARD_WEIGHTS = ("stashed", "live")
REPLICATIONS = ("shared", "replicas")
# What --replication replicas applies to (algorithms.md §3a), and where it runs so far.
REPLICATED = ("asgd", "pdasgd", "pdasgd-block")
# delayed-nesterov: async-local's outer optimizer, its momentum moved once per N arrivals.
OUTER_OPTIMIZERS = ("none", "sgd", "nesterov", "delayed-nesterov")
# How many local steps an async-local replica runs per round: --period H, or DyLU's share of H
# by its measured speed (Liu et al., arXiv 2401.09135).
LOCAL_STEPS = ("fixed", "dynamic")
# Those with versioned parameter stores, whose reads and updates --event-log records: one shared
# store, or one per device (lpp, and the others with --replication replicas) with the averaging's
# snapshots, rounds and merges.
EVENT_LOG_ALGOS = ("asgd", "pdasgd", "pdasgd-block", "lpp")
# How the simulator computes shared-store asgd, pdasgd and pdasgd-block: each job's kernels as
# the clock reaches them, or the schedule first and the numerics as compiled loops.
NUMERICS = ("event", "compiled")
