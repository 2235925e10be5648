"""The messages between the processes of an async-local run (``runtime.async_local_processes``)
and the watch that stops every process when one fails.

A message is one key of the coordination service's key-value store (``processes.kv_store``)
under the run's prefix (``processes.run_keys``): a JSON header of counts, then its arrays' raw
bytes (``pack``; exact for every dtype), deleted once read. That is fine for models of
megabytes, and no production parameter server.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pdasgd_jax.runtime.processes import kv_store
from pdasgd_jax.runtime.queue import QueueClosed

PyTree = Any
_WAIT_MS = 200  # one blocking read of the store; a stop is noticed between two
_HEADER = struct.Struct("<Q")


def pack(meta: dict[str, Any], tree: PyTree = ()) -> bytes:
    """``meta`` (JSON) and the leaves of ``tree`` as raw bytes: exact for every dtype.

    Args:
      meta: JSON-serialisable counts.
      tree: arrays (host or device).

    Returns:
      One message's bytes: the header's length, the header (``meta``, each leaf's dtype and
      shape), then each leaf's bytes.

    Examples:
        >>> meta, leaves = unpack(pack({"v": 1}, [np.arange(3, dtype=np.int8)]))
        >>> meta, leaves[0].tolist()
        ({'v': 1}, [0, 1, 2])
    """
    leaves = [np.ascontiguousarray(np.asarray(x)) for x in jax.tree.leaves(tree)]
    header = json.dumps({"meta": meta, "leaves": [(x.dtype.name, x.shape) for x in leaves]}).encode()
    return b"".join([_HEADER.pack(len(header)), header, *(x.tobytes() for x in leaves)])


def unpack(data: bytes) -> tuple[dict[str, Any], list[np.ndarray]]:
    """``pack``'s ``meta`` and leaves.

    Args:
      data: ``pack``'s bytes.

    Returns:
      ``(meta, leaves)``, the leaves read-only views of ``data`` in ``tree``'s leaf order.
    """
    (n,) = _HEADER.unpack_from(data)
    header = json.loads(data[_HEADER.size : _HEADER.size + n])
    offset, leaves = _HEADER.size + n, []
    for dtype_name, shape in header["leaves"]:
        dtype = np.dtype(jnp.dtype(dtype_name))
        count = int(np.prod(shape))
        leaves.append(np.frombuffer(data, dtype, count, offset).reshape(shape))
        offset += dtype.itemsize * count
    return header["meta"], leaves


class Channel:
    """Messages between the processes of one run through the coordination service's store.

    Args:
      keys: the run's key prefix (``run_keys()``).
      stopped: a stop makes a waiting ``receive`` raise ``QueueClosed``.
      kv: the key-value client (default: ``kv_store()``).
    """

    def __init__(self, keys: str, stopped: Callable[[], bool], kv: Any = None):
        self._keys, self._stopped = keys, stopped
        self._kv = kv_store() if kv is None else kv

    def send(self, name: str, meta: dict[str, Any], tree: PyTree = ()) -> None:
        """Writes message ``name`` (read once, by one receiver)."""
        self._kv.key_value_set_bytes(f"{self._keys}/{name}", pack(meta, jax.device_get(tree)))

    def has(self, name: str) -> bool:
        """Whether message ``name`` is there."""
        return bool(self._kv.key_value_dir_get_bytes(f"{self._keys}/{name}"))

    def receive(self, name: str, *, keep: bool = False) -> tuple[dict[str, Any], list[np.ndarray]]:
        """Waits for message ``name`` and returns it unpacked, deleting it unless ``keep``.

        Raises:
          QueueClosed: ``stopped()`` while it waits.
        """
        key = f"{self._keys}/{name}"
        while True:
            if self._stopped():
                raise QueueClosed
            try:
                data = self._kv.blocking_key_value_get_bytes(key, _WAIT_MS)
            except jax.errors.JaxRuntimeError as exc:
                if "CANCELLED" in str(exc):  # this process left the coordinator (a peer failed): it ends
                    raise QueueClosed from exc
                if "DEADLINE_EXCEEDED" not in str(exc):
                    raise
                continue
            if not keep:
                self._kv.key_value_delete(key)
            return unpack(data)
