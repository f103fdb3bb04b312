"""Stage 4's paged backend checks the index arrays a learner builds (not graded: provided code):
a wrong kv_indptr fails at once, saying what it must be, instead of deep inside an attention
kernel (flash-attn's stand-in only noticed that max_seqlen_k did not match). So does kv_indices
taken past a request's seq_len (the whole table row), which made the next request's keys wrong."""

from __future__ import annotations

import pytest
import torch

from s00_foundation.forward_batch import ForwardBatch
from s04_paged_kv_pool.paged_backend import ForwardMetadata, check_indptr


def test_a_wrong_kv_indptr_says_it_must_be_the_running_sum_of_seq_lens():
    check_indptr("kv_indptr", torch.tensor([0, 5, 8], dtype=torch.int32), [5, 3], "seq_lens")  # right: no error
    with pytest.raises(
        ValueError, match=r"kv_indptr must be the running sum of seq_lens starting at 0.*\[0, 5, 8\].*got \[0, 1, 2\]"
    ):
        check_indptr("kv_indptr", torch.tensor([0, 1, 2], dtype=torch.int32), [5, 3], "seq_lens")  # extend_lens' sum
    with pytest.raises(ValueError, match="as int32"):
        check_indptr("kv_indptr", torch.tensor([0, 5, 8]), [5, 3], "seq_lens")  # int64


def test_kv_indices_past_a_requests_seq_len_say_what_they_must_hold():
    batch = ForwardBatch.build([[1, 2], [3]], [3, 2], attn_backend=None)  # seq_lens [5, 3]
    qo_indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 5, 8], dtype=torch.int32)
    ForwardMetadata(batch, qo_indptr, kv_indptr, torch.arange(8))  # right: no error
    with pytest.raises(ValueError, match=r"kv_indices must hold sum\(seq_lens\) = 8 slots.*up to its seq_len.*got 16"):
        ForwardMetadata(batch, qo_indptr, kv_indptr, torch.arange(16))  # two whole table rows of width 8
