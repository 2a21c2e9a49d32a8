"""A GGUF file's metadata (key/value fields) and tensor shapes as plain Python values.

Read here with struct and numpy from the file's header (the `gguf` package's GGUFReader takes
seconds on a 49k-token vocabulary, building an object per string; this takes tens of
milliseconds). The layout (ggml's docs/gguf.md): magic "GGUF", version, tensor count, field
count, the fields (key, type, value), then each tensor's name, dims (innermost first), type and
offset. Little-endian files, version 2 and 3.
"""
from __future__ import annotations

import functools
import mmap
import struct
from pathlib import Path

import numpy as np

from services.core.errors import InvalidArgument

GGUF_SUFFIX = ".gguf"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_F32 = 0  # ggml's tensor type code


def is_gguf_file(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF_SUFFIX and Path(path).is_file()


def read_metadata(path: str | Path) -> dict:
    """Every field but the file-format ones (GGUF.*), token lists included."""
    return dict(_cached(path)[0])


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in Hugging Face order ([out_features, in_features]: ggml lists dims innermost first)."""
    return dict(_cached(path)[1])


def tensor_types(path: str | Path) -> dict[str, int]:
    """Each tensor's ggml type id (gguf.GGMLQuantizationType's values), from the header alone."""
    return dict(_cached(path)[3])


def read_tensor(path: str | Path, name: str) -> list[float]:
    """A small F32 tensor's values (rope_freqs), read at its offset in the data section."""
    start = dict(_cached(path)[2]).get(name)
    if start is None:
        raise InvalidArgument("model", f"{Path(path).name} has no F32 tensor {name!r}")
    offset, count = start
    with open(path, "rb") as file:
        file.seek(offset)
        return np.frombuffer(file.read(4 * count), "<f4").tolist()


def _cached(path: str | Path) -> tuple:
    path = Path(path).resolve()
    return _read(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(path: str, _mtime: int) -> tuple:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _parse(data)
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as exc:
            raise InvalidArgument("model", f"{path} is not a readable GGUF file: {exc}") from exc


def _parse(data) -> tuple:
    if data[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version, num_tensors, num_fields = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"version {version} (served: 2, 3)")
    reader = _Reader(data, 24)
    fields = []
    for _ in range(num_fields):
        key = reader.string()
        value = reader.value(reader.scalar("<I"))
        if not key.startswith("GGUF."):
            fields.append((key, value))
    shapes, types, f32 = [], [], []
    for _ in range(num_tensors):
        name = reader.string()
        dims = [reader.scalar("<Q") for _ in range(reader.scalar("<I"))]
        kind, offset = reader.scalar("<I"), reader.scalar("<Q")
        shapes.append((name, tuple(reversed(dims))))
        types.append((name, kind))
        if kind == _F32:
            f32.append((name, offset, int(np.prod(dims))))
    align = int(dict(fields).get("general.alignment", 32))
    data_start = (reader.pos + align - 1) // align * align
    return (tuple(fields), tuple(shapes), tuple((name, (data_start + offset, count)) for name, offset, count in f32),
            tuple(types))


class _Reader:
    def __init__(self, data, pos: int):
        self.data, self.pos = data, pos

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        size = self.scalar("<Q")
        text = self.data[self.pos:self.pos + size].decode("utf-8", errors="surrogateescape")
        self.pos += size
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item])
                values = np.frombuffer(self.data, dtype, count, self.pos)
                self.pos += dtype.itemsize * count
                return values.tolist()
            return [self.value(item) for _ in range(count)]
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        raise ValueError(f"unknown value type {kind}")
