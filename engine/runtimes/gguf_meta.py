"""A GGUF file's metadata and tensor table, read in one pass without touching tensor data.

gguf-py's GGUFReader builds a numpy memmap view for every part of every field: for a
151,936-token vocabulary and its 151,387 merges that is ~3 million views and 10-25 s on a
2-core CPU, paid at every engine start. The ggml runtime needs only the values (llama.cpp
reads the tensors itself), so this reads the same header with ``struct`` in well under a
second. It offers the slice of GGUFReader's interface the loader uses: ``fields[key].contents()``
and ``tensors`` with ``name`` and ``shape`` (dimensions in file order, as GGUFReader gives them).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
# value type -> struct format of one item (strings and arrays are read by hand)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
MAX_ITEMS = 1 << 24  # a sanity cap on array lengths and counts: a corrupt header must not allocate wildly
_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class Field:
    name: str
    value: object

    def contents(self) -> object:
        return self.value


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.data):
            raise GGUFFormatError("header ends early")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.data):
            raise GGUFFormatError("header ends early")
        raw = self.data[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, n: int) -> list[str]:
        """``n`` strings in a row: the vocabulary and merges (300k of them for Qwen), in one tight loop."""
        data, pos, end = self.data, self.pos, len(self.data)
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(n):
                (size,) = unpack(data, pos)
                pos += 8
                if pos + size > end:
                    raise GGUFFormatError("header ends early")
                append(data[pos : pos + size].decode("utf-8", errors="replace"))
                pos += size
        except struct.error:
            raise GGUFFormatError("header ends early") from None
        self.pos = pos
        return out

    def count(self) -> int:
        n = self.take("Q")
        if n > MAX_ITEMS:
            raise GGUFFormatError(f"implausible count {n}")
        return n

    def value(self, vtype: int):
        if vtype == STRING:
            return self.string()
        if vtype == ARRAY:
            itype, n = self.take("I"), self.count()
            if itype == STRING:
                return self.strings(n)
            fmt = _SCALARS.get(itype)
            if fmt is None:
                raise GGUFFormatError(f"unsupported array item type {itype}")
            size = struct.calcsize("<" + fmt)
            if self.pos + n * size > len(self.data):
                raise GGUFFormatError("header ends early")
            items = list(struct.unpack_from(f"<{n}{fmt}", self.data, self.pos))
            self.pos += n * size
            return items
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise GGUFFormatError(f"unsupported value type {vtype}")
        return self.take(fmt)


class GGUFMeta:
    """``fields`` (key -> Field) and ``tensors`` (TensorInfo, in file order) of a GGUF file."""

    def __init__(self, path: str | Path, chunk: int = 64 << 20) -> None:
        with open(path, "rb") as f:
            head = f.read(chunk)  # metadata sits at the start; re-read whole only if it is bigger
            try:
                self._parse(head)
            except GGUFFormatError as exc:
                if "ends early" not in str(exc) or len(head) < chunk:
                    raise
                f.seek(0)
                self._parse(f.read())

    def _parse(self, data: bytes) -> None:
        if data[:4] != MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        c = _Cursor(data)
        c.pos = 4
        version = c.take("I")
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = c.count(), c.count()
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = c.string()
            self.fields[key] = Field(key, c.value(c.take("I")))
        self.tensors: list[TensorInfo] = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.take("I")
            if n_dims > 8:
                raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
            shape = tuple(c.take("Q") for _ in range(n_dims))
            ggml_type = c.take("I")
            c.take("Q")  # data offset: llama.cpp reads the data, not us
            self.tensors.append(TensorInfo(name, shape, ggml_type))
