"""Checks of the files sparseffn saves and reads back: a damaged file is one error naming it.

Every reader of a saved file goes through here (or raises `SavedFileError` itself), so truncation,
corruption and wrong content surface as one line, `<path>: <what is wrong>`, never as the traceback of
a parser deep inside safetensors, tokenizers or json:

- `read_json_object`: config.json, run.json, generation_config.json, index and manifest files;
- `check_safetensors`: the layout of a `.safetensors` file: an 8-byte little-endian header length N,
  N bytes of JSON (name -> dtype, shape, data_offsets), then the tensor bytes, which the offsets must
  tile exactly; a cut file, a damaged header or an entry whose offsets disagree with its dtype and
  shape is refused before any tensor is read;
- `check_model_dir`: a `save_pretrained` folder: its JSON files, and every safetensors shard its
  `model.safetensors.index.json` names (or its one `model.safetensors`);
- `file_sha256`: the digest the training checkpoints' manifests record (train/checkpoint.py, whose
  `CheckpointError` is a `SavedFileError`).

Flipped bits inside tensor data pass the layout check; only a recorded digest catches those (the
checkpoints have one).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
_READ_CHUNK = 1 << 20
_MAX_HEADER = 100 << 20  # the safetensors format's own limit on the JSON header
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


class SavedFileError(ValueError):
    """A saved file that cannot be used: truncated, corrupted, or not what its name says. The message
    starts with the file's path."""


def file_sha256(path: str | Path) -> str:
    """The sha256 hex digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_json_object(path: str | Path) -> dict:
    """The JSON object stored in `path`; FileNotFoundError when it is missing, SavedFileError when it is
    empty, cut short, not UTF-8 JSON or not an object."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    raw = path.read_bytes()
    if not raw.strip():
        raise SavedFileError(f"{path}: empty (0 bytes of JSON)" if not raw else f"{path}: holds only whitespace")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise SavedFileError(f"{path}: not UTF-8 JSON ({err.reason} at byte {err.start}): corrupted?") from None
    except json.JSONDecodeError as err:
        raise SavedFileError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno}, "
                             f"{len(raw)} bytes): truncated or corrupted?") from None
    if not isinstance(data, dict):
        raise SavedFileError(f"{path}: holds a JSON {type(data).__name__}, not the object it should")
    return data


def check_safetensors(path: str | Path) -> None:
    """Raise SavedFileError unless `path` is a whole, well-formed safetensors file (module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    size = path.stat().st_size
    if size < 8:
        raise SavedFileError(f"{path}: truncated ({size} bytes, shorter than the 8-byte header length)")
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > min(size - 8, _MAX_HEADER):
            raise SavedFileError(f"{path}: truncated or corrupted (its header length {length} exceeds the "
                                 f"{size - 8} bytes that follow)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError(f"a JSON {type(header).__name__}, not an object")
    except ValueError as err:
        raise SavedFileError(f"{path}: corrupted safetensors header ({err})") from None
    data_bytes = size - 8 - length
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(v) for v in entry["data_offsets"])
            count = math.prod(int(d) for d in entry["shape"])
            width = _DTYPE_BYTES.get(entry["dtype"])  # a dtype this table lacks: only its offsets are checked
        except (KeyError, TypeError, ValueError) as err:
            raise SavedFileError(f"{path}: corrupted safetensors header (tensor {name!r}: {err!r})") from None
        if not 0 <= begin <= stop or (width is not None and stop - begin != count * width):
            raise SavedFileError(f"{path}: corrupted safetensors header (tensor {name!r} has offsets "
                                 f"[{begin}, {stop}) for {count} x {entry['dtype']})")
        end = max(end, stop)
    if end != data_bytes:
        cut = "truncated" if data_bytes < end else "longer than its header describes"
        raise SavedFileError(f"{path}: {cut} ({size} bytes, its header describes {8 + length + end})")


def check_model_dir(folder: str | Path) -> None:
    """Check a `save_pretrained` folder before it is loaded: every *.json file parses as an object, and
    the safetensors shards its index names (or its single model.safetensors) are whole (SavedFileError
    naming the first bad file; FileNotFoundError naming a shard the index lists that is missing)."""
    folder = Path(folder)
    for path in sorted(folder.glob("*.json")):
        read_json_object(path)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise SavedFileError(f"{index}: has no 'weight_map' of tensor names to shard files")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        for shard in shards:
            check_safetensors(folder / shard)
    elif (folder / SAFETENSORS_SINGLE).exists():
        check_safetensors(folder / SAFETENSORS_SINGLE)
