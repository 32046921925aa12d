"""Reading safetensors weights: into a new fp32 array, or straight into a tensor's own memory (CPU's load path)."""
import numpy as np
import pytest

from finetune.io.hf_io import _write_shard, fp32_to_bf16, read_into, read_tensor


@pytest.mark.parametrize("st_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("part", [None, (0, 2, 3), (1, 1, 4)])
def test_read_into_writes_what_read_tensor_returns(tmp_path, st_dtype, part):
    """load_weights on CPU reads each tensor into its Parameter's memory (no host copy left behind in the heap,
    docs/memory.md); the values are read_tensor's, for every dtype and a TP slice along either axis."""
    rng = np.random.default_rng(0)
    full = rng.standard_normal((6, 7)).astype(np.float32)
    stored = {"float32": full, "float16": full.astype(np.float16), "bfloat16": fp32_to_bf16(full)}[st_dtype]
    path = tmp_path / "model.safetensors"
    _write_shard(path, {"w": stored}, st_dtype)
    want = read_tensor(path, "w", part)
    assert want.dtype == np.float32 and not np.array_equal(want, np.zeros_like(want))
    out = np.zeros_like(want)
    read_into(out, path, "w", part)
    np.testing.assert_array_equal(out, want)
