"""Chapters 10-13: data, tensor, sequence (and pipeline, context) parallelism on real torch.distributed.

    dims.py      ParallelDims(dp, tp, pp, cp): every process group from one grid, passed in explicitly
    comm.py      every collective, one autograd.Function per primitive, and a byte counter (CommLog)
    data.py      chapter 10: naive and bucketed DDP, ZeRO-1/2/3 (a distributed optimizer, FSDP)
    tensor.py    chapter 11: column/row-parallel linears, GQA-aware head split, vocab-parallel embedding and CE
    sequence.py  chapter 11: sequence parallelism and the TP(+SP) GPT built from the dense one
    runtime.py   what ``torchrun -m minite.train --parallel.*`` uses (setup_parallel)
"""
from minite.parallel.dims import ParallelDims, ParallelError, init_distributed  # noqa: F401

__all__ = ["ParallelDims", "ParallelError", "init_distributed"]
