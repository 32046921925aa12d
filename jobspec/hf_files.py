"""Reading a Hugging Face model directory's files without MindSpore (the launcher's preflight uses it)."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"  # an export's weights: one file, or an index
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # peft's adapter directory
ADAPTER_BASE = "base_model.json"  # ours, beside peft's files: the identity of the base model the adapter trained on


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """Safetensors header (name -> dtype/shape/data_offsets) and the byte offset of the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n
