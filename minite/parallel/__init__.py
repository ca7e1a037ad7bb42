"""Chapters 10-13: data, tensor, sequence (and pipeline, context) parallelism on real torch.distributed.

    dims.py      ParallelDims(dp, tp, pp, cp): every process group from one grid, passed in explicitly;
                 init_distributed / select_device: NCCL + cuda:LOCAL_RANK only with a GPU per local rank, else gloo
    comm.py      every collective, one autograd.Function per primitive, a byte counter (CommLog), and the
                 global-norm gradient clipping of sharded parameters (clip_grad_norm_)
    trace.py     what the layers did in time and bytes, recorded only under ``with trace.Recorder()`` (the lessons)
    data.py      chapter 10: naive and bucketed DDP, ZeRO-1/2/3 (a distributed optimizer, FSDP)
    tensor.py    chapter 11: column/row-parallel linears (+ the SP column linear), GQA-aware head split,
                 vocab-parallel embedding and CE
    sequence.py  chapter 11: sequence parallelism and the TP(+SP) GPT built from the dense one
    pipeline_schedule.py  chapter 12: GPipe / 1F1B schedules as data (the bubble formula)
    pipeline_stage.py     chapter 12: where to cut the GPT (balanced by parameters) and one stage as a module
    pipeline.py  chapter 12: PipelineGPT, the schedule run over point-to-point sends between stages
    context.py   chapter 13: ring attention and all-gather CP attention (LSE merge, load-balanced layout)
    context_gpt.py  chapter 13: the CP GPT built from the dense one (my tokens of each sequence)
    runtime.py   what ``torchrun -m minite.train --parallel.*`` uses (setup_parallel)
    launch.py    torchrun as a subprocess for tests and notebook cells; worker_env: the interpreter only without a GPU
    workers/     the torchrun workers of the tests, the lessons' measurements and the exercise graders (CPU
                 tensors, gloo): ``python -m minite.parallel.workers CHECK ... --out DIR``, one file per chapter
"""
from minite.parallel.dims import ParallelDims, ParallelError, init_distributed, select_device  # noqa: F401

__all__ = ["ParallelDims", "ParallelError", "init_distributed", "select_device"]
