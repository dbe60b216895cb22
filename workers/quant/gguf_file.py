"""A GGUF file's tensors and scalar metadata, read from the mapped file at load.

gguf's GGUFReader makes a numpy view of every part of every metadata value: the default model's
49,152 token strings alone are ~300,000 slices of a memmap, 2.2 s per reader, and every worker
made one at load (the tokenizer is the frontend's business; a worker needs the tensors). This
reads the header with `struct` and steps over array values without reading them (a few
milliseconds), and gives each tensor the view GGUFReader gives (the same dtype, shape and bytes),
so that gguf's `dequantize` and transformers' tensor processors take it as they take GGUFReader's.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

# struct format of each scalar value type
_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}

# Tensor types GGUFReader views as numbers; every other type (BF16 included) as rows of bytes.
_NUMERIC = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order, the fastest-varying dimension first
    data: np.ndarray  # numpy's order (shape reversed); a quantized type's rows as bytes


class GGUFFile:
    """`metadata`: the scalar and string values (arrays are stepped over); `tensors`: in file
    order, their data read-only views of the mapped file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:4] != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (magic {bytes(self._map[:4])!r})")
        self._order = "<"
        (version,) = struct.unpack_from("<I", self._map, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order = ">"
            (version,) = struct.unpack_from(">I", self._map, 4)
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported")
        num_tensors, num_fields = self._unpack("QQ", 8)
        self._offset = 24
        self.metadata: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            (value_type,) = self._next("I")
            value = self._value(GGUFValueType(value_type))
            if value is not None:
                self.metadata[key] = value
        infos = [self._tensor_info() for _ in range(num_tensors)]
        if len({name for name, *_ in infos}) != len(infos):
            raise ValueError(f"{self.path}: a tensor name appears twice")
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{self.path}: alignment {alignment} is not a power of two")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in infos]

    def _unpack(self, fmt: str, offset: int) -> tuple:
        return struct.unpack_from(self._order + fmt, self._map, offset)

    def _next(self, fmt: str) -> tuple:
        values = self._unpack(fmt, self._offset)
        self._offset += struct.calcsize("<" + fmt)
        return values

    def _string(self) -> str:
        (length,) = self._next("Q")
        start, self._offset = self._offset, self._offset + length
        return self._map[start : self._offset].decode("utf-8")

    def _value(self, value_type: GGUFValueType) -> object:
        """Reads one value; an array is stepped over (None)."""
        if value_type == GGUFValueType.STRING:
            return self._string()
        if value_type in _SCALARS:
            return self._next(_SCALARS[value_type])[0]
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        item_type, count = self._next("IQ")
        item_type = GGUFValueType(item_type)
        if item_type in _SCALARS:
            self._offset += count * struct.calcsize("<" + _SCALARS[item_type])
        elif item_type == GGUFValueType.STRING:  # a vocabulary: lengths read, bytes skipped
            length_format, offset = self._order + "Q", self._offset
            for _ in range(count):
                offset += 8 + struct.unpack_from(length_format, self._map, offset)[0]
            self._offset = offset
        else:
            for _ in range(count):
                self._value(item_type)
        return None

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (num_dims,) = self._next("I")
        shape = self._next("Q" * num_dims)
        (tensor_type,) = self._next("I")
        (offset,) = self._next("Q")
        return name, shape, GGMLQuantizationType(tensor_type), offset

    def _tensor(
        self, data_start: int, name: str, shape: tuple[int, ...], kind: GGMLQuantizationType,
        offset: int,
    ) -> GGUFTensor:  # fmt: skip
        num_elements = int(np.prod(shape, dtype=np.int64))
        dims = tuple(reversed(shape))
        if kind in _NUMERIC:
            dtype, count = np.dtype(_NUMERIC[kind]).newbyteorder(self._order), num_elements
        else:
            block_size, type_size = GGML_QUANT_SIZES[kind]
            dtype, count = np.dtype(np.uint8), num_elements * type_size // block_size
            dims = quant_shape_to_byte_shape(dims, kind)
        data = np.frombuffer(self._map, dtype, count, data_start + offset).reshape(dims)
        return GGUFTensor(name, kind, shape, data)
