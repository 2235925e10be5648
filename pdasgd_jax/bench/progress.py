"""A progress bar over a benchmark's runs, on stderr, so a benchmark that takes minutes or
hours shows that it is alive and how far it has come.

``run_benchmark`` opens one bar per benchmark (``bar``); the protocols call ``tick`` after
each training run or timed measurement. Runs are counted, not planned: a tuning grid widens
while its best rate sits on an edge, so the total is not known in advance.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from tqdm.auto import tqdm

_bar: tqdm | None = None


@contextlib.contextmanager
def bar(name: str, *, enabled: bool = True) -> Iterator[None]:
    """Shows benchmark ``name``'s bar while the block runs (``enabled=False``: none)."""
    global _bar
    _bar = tqdm(desc=f"bench {name}", unit=" runs", file=sys.stderr, disable=not enabled, dynamic_ncols=True)
    try:
        yield
    finally:
        _bar.close()
        _bar = None


def tick(label: str = "") -> None:
    """One more run done (``label``: what it was); a no-op outside ``bar``."""
    if _bar is not None:
        if label:
            _bar.set_postfix_str(label, refresh=False)
        _bar.update(1)
