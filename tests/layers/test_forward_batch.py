"""ForwardBatch's one-copy upload: every index tensor starts on a 16-byte boundary (Triton compiles a kernel
variant per pointer alignment; views at arbitrary offsets would compile new variants while serving)."""

import numpy as np
import torch

from deepserve.layers.forward_batch import upload_int64


def test_upload_views_are_16_byte_aligned_and_exact():
    parts = [np.arange(3), [], np.arange(10, 15), [7], np.arange(4)]
    views = upload_int64(parts, torch.device("cpu"))
    assert [v.tolist() for v in views] == [list(np.asarray(p, dtype=np.int64)) for p in parts]
    assert all(v.data_ptr() % 16 == 0 for v in views if v.numel())
    assert all(v.dtype == torch.int64 for v in views)
