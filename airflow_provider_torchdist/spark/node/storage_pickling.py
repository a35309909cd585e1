"""Pickling rank 0's value with tensor memory written as it is, so it travels without copies.

torch pickles a CPU storage by ``torch.save``-ing it into a bytes object (a second copy of every
tensor in rank 0), and unpickles it by ``torch.load``-ing those bytes (a second copy in the loading
process, held by the unpickler's memo until the end). :class:`OutputPickler` writes a CPU storage's
memory straight into the pickle instead (a protocol 5 ``PickleBuffer``), and
:func:`storage_from_buffer` makes the loaded storage use the very bytearray the unpickler read it
into. Rank 0 then holds its value once while pickling it, and ``load_output`` builds it once.

Loaded storages live in those bytearrays, so like the storages of ``torch.load(mmap=True)`` they
cannot be resized (``Tensor.resize_`` beyond their size fails; everything else works).
"""

from __future__ import annotations

import ctypes
import pickle
import sys
import warnings
from typing import Any

import cloudpickle


def storage_from_buffer(buffer: bytearray, dtype: Any) -> Any:
    """The storage :class:`OutputPickler` wrote: ``buffer``'s memory, shared, as ``dtype``."""
    import torch

    if len(buffer):
        untyped = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
    else:
        untyped = torch.UntypedStorage(0)
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


class OutputPickler(cloudpickle.Pickler):
    """cloudpickle's pickler, with CPU tensor storages written from their own memory.

    Use protocol 5. The value must not change while it is pickled (the pickle reads tensor memory
    in place).
    """

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.storage.TypedStorage:
            with warnings.catch_warnings():  # TypedStorage's deprecation notice: we only read it
                warnings.simplefilter("ignore", UserWarning)
                untyped = obj.untyped()
            if untyped.device.type != "cpu":
                return super().reducer_override(obj)
            size = untyped.nbytes()
            # Writable, so protocol 5 stores it in-band as a bytearray: loaded as one, mutable.
            data = (
                pickle.PickleBuffer((ctypes.c_char * size).from_address(untyped.data_ptr()))
                if size
                else bytearray()
            )
            return storage_from_buffer, (data, obj.dtype)
        return super().reducer_override(obj)


def dump_output(value: Any, file: Any) -> None:
    """Pickle ``value`` into ``file`` (anything with ``write``) with :class:`OutputPickler`."""
    OutputPickler(file, protocol=5).dump(value)
