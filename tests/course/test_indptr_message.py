"""Stage 4's paged backend checks the index arrays a learner builds (not graded: provided code):
a wrong kv_indptr fails at once, saying what it must be, instead of deep inside an attention
kernel (flash-attn's stand-in only noticed that max_seqlen_k did not match)."""

from __future__ import annotations

import pytest
import torch

from s04_paged_kv_pool.paged_backend import check_indptr


def test_a_wrong_kv_indptr_says_it_must_be_the_running_sum_of_seq_lens():
    check_indptr("kv_indptr", torch.tensor([0, 5, 8], dtype=torch.int32), [5, 3], "seq_lens")  # right: no error
    with pytest.raises(
        ValueError, match=r"kv_indptr must be the running sum of seq_lens starting at 0.*\[0, 5, 8\].*got \[0, 1, 2\]"
    ):
        check_indptr("kv_indptr", torch.tensor([0, 1, 2], dtype=torch.int32), [5, 3], "seq_lens")  # extend_lens' sum
    with pytest.raises(ValueError, match="as int32"):
        check_indptr("kv_indptr", torch.tensor([0, 5, 8]), [5, 3], "seq_lens")  # int64
