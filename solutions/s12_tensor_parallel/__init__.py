"""Stage 12: tensor parallelism - each layer split across ranks (column- and row-parallel
linears, a vocabulary-parallel embedding and LM head, two all-reduces per layer), weights and
KV heads sharded at load time, rank 0 scheduling and broadcasting each step's batch, on
``torch.distributed`` (gloo on a CPU, NCCL on GPUs)."""
