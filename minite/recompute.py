"""Activation recompute per transformer block: trade compute for memory (``--train.recompute=none|selective|full``).

Why. Backward needs the forward's intermediate tensors (the *activations*): a matmul's input for its weight
gradient, a norm's input and 1/rms, the rotated q and k for attention, the SwiGLU gate and up, the dropout masks.
Autograd keeps every one of them from the forward until the backward consumes it, so the memory of a training step
grows like ``n_layer x B x T x (a few dozen) x C`` and, not the parameters, is what runs out first on long
sequences. Recompute (Chen et al. 2016, "Training deep nets with sublinear memory cost") keeps less and runs part
of the forward again during the backward to rebuild what it dropped.

The three modes (one block's forward is the unit; ``apply_recompute(model, mode)`` sets it for every block):

    none       keep everything autograd wants                  memory: all of it       extra compute: 0
    full       keep only the block's input x (B, T, C); the    memory: ~1 tensor/block  extra compute: one whole
               backward re-runs the whole block forward first                          forward (~ +33% of a step)
    selective  keep the outputs of the expensive ops, re-run   memory: in between       extra compute: only the
               the cheap ones                                                           cheap elementwise ops

Megatron's selective recompute (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models") measures each activation by bytes stored vs FLOPs to rebuild, and finds the *core attention*
(QK^T, softmax, dropout, attention x V: the 5 a s / h term, quadratic in T) is the big-but-cheap one: it recomputes
only that and keeps the GEMM outputs. With a flash-attention kernel the T x T matrices never exist, so that term
is already gone; what is left that is large *and* cheap to rebuild is the elementwise work between the GEMMs.
minite's ``selective`` policy therefore is (an op-level policy run by torch's selective activation checkpointing,
``torch.utils.checkpoint.create_selective_checkpoint_contexts``, torch >= 2.4):

    SAVE       outputs of GEMMs (aten mm / addmm / bmm / baddbmm / _scaled_mm: the qkv, proj, gate_up, down
               projections) and of scaled-dot-product attention (its output and logsumexp): O(T^2) or O(C^2)
               FLOPs per element to rebuild
    RECOMPUTE  everything else: RMSNorm, RoPE, SwiGLU's silu(gate) * up, residual adds, dropout, views, copies:
               a handful of FLOPs per element, memory-bound, and often *several* saved tensors each (a norm
               keeps x and 1/rms, SwiGLU keeps gate and up, dropout keeps its mask)
    RECOMPUTE  every op that mutates its input (in-place ops, c10d collectives such as the tensor-parallel
               all-reduce): SAC can replay an op's *return value* from its cache, not its side effect on an
               argument, so those must run again. The TP collectives thus run once more in the backward, on every
               rank in the same order (the recompute replays the same program), which is correct, and costs
               communication: Megatron's selective mode avoids that because it recomputes only core attention.

Dropout is random: ``checkpoint`` saves the CPU and CUDA RNG states before the forward and restores them before the
recompute, and no random op is ever saved, so the recomputed masks are the forward's masks bit for bit.

The Triton kernels. In eager mode minite's autograd Functions launch Triton kernels directly, outside the
dispatcher (each concept file's @register_op, kernels/_common.py, registers them as custom ops only for
torch.compile on CUDA), so a
dispatch-level policy sees only the ``torch.empty`` that allocates a kernel's output, never the kernel. Those
outputs are recomputed: the Function's forward runs again in the backward and relaunches its kernel, which writes a
freshly allocated buffer, so values stay exact; with the Triton attention that is Megatron's choice (attention is
recomputed), with the PyTorch reference (SDPA) it is saved. No launcher writes into a tensor it did not allocate,
so no cached tensor is ever mutated (SAC would raise if one were).

Cost in eager mode: SAC sends every op of the block through a Python dispatch mode, in the forward and again in the
recompute. On a small model on the CPU that per-op overhead outweighs the skipped GEMMs, and selective measured
slower than full (benchmarks/bench_recompute.py); it pays where GEMMs dominate (large C) or under torch.compile.

What the recompute does *not* restore: torch.autocast is restored by ``checkpoint`` itself, but minite's
``fp8_autocast`` is a thread-local flag and its delayed-scaling state (amax history, scale) advances at every
quantize; a recompute outside the context would run in high precision and one inside would advance the history
twice. TransformerEngine freezes the FP8 metadata during its recompute phase; minite does not (yet), so a
recomputing block refuses to run under FP8 (a RuntimeError), and the config rejects ``--precision fp8`` with
recompute.

How. ``checkpoint(fn, x, use_reentrant=False)`` (the non-reentrant kind: saved-tensor hooks, works with inputs that
do not require grad, with forward/backward hooks and with parameters freed and gathered again between forward and
backward as ZeRO-3 does) wraps the block's own forward, installed as an *instance* attribute: no wrapper Module,
so parameter names and ``state_dict`` keys stay the same and checkpoints load across modes. With a KV cache or
under ``no_grad`` (sampling, evaluation) the plain forward runs: nothing is saved there anyway.
"""
from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from minite.errors import ConfigError

__all__ = ["MODES", "apply_recompute", "recompute_mode", "selective_policy", "SAVE_OPS", "measure"]

MODES = ("none", "selective", "full")
_ORIG, _MODE = "_minite_recompute_orig", "_minite_recompute_mode"  # instance attributes (never in state_dict)


def _ops(*names: str) -> frozenset:
    """The aten overloads among `names` that this torch build has (attention kernels vary by version/device)."""
    found = []
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload or "default", None)
        if op is not None:
            found.append(op)
    return frozenset(found)


# GEMMs (F.linear / matmul decompose into these below autograd) and every fused attention forward.
SAVE_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
                "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_flash_attention_forward", "_efficient_attention_forward")


def selective_policy(ctx, op, *args, **kwargs):
    """SAC policy: save GEMM and attention outputs, recompute the rest (and always ops that mutate an input)."""
    from torch.utils.checkpoint import CheckpointPolicy
    if op in SAVE_OPS and not op._schema.is_mutable:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    return create_selective_checkpoint_contexts(selective_policy)


def _recompute_forward(self, *args, **kwargs):
    """The block's forward under its recompute mode (installed per instance by apply_recompute)."""
    plain = getattr(self, _ORIG)
    kv_cache = kwargs.get("kv_cache", args[1] if len(args) > 1 else None)
    if kv_cache is not None or not torch.is_grad_enabled():
        return plain(*args, **kwargs)  # sampling / evaluation: nothing is kept for a backward anyway
    from minite.formats.autocast import is_fp8_enabled
    if is_fp8_enabled():
        raise RuntimeError(f"activation recompute ({getattr(self, _MODE)!r}) does not support fp8_autocast yet: the "
                           "recompute would quantize with an advanced delayed-scaling state; use "
                           "--train.recompute=none with --precision fp8")
    if getattr(self, _MODE) == "full":
        return checkpoint(plain, *args, use_reentrant=False, **kwargs)
    return checkpoint(plain, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)


def _block_types() -> tuple[type, ...]:
    from minite.models.gpt import Block
    from minite.parallel.sequence import TPBlock  # lazily: minite.parallel pulls in torch.distributed
    return (Block, TPBlock)


def recompute_mode(block: nn.Module) -> str:
    """The recompute mode a block runs with ("none" when apply_recompute never changed it)."""
    return getattr(block, _MODE, "none")


def apply_recompute(model: nn.Module, mode: str) -> int:
    """Make every transformer block of `model` (minite Block or TPBlock, wherever it sits: ModuleList, ModuleDict,
    inside wrappers) run with activation recompute `mode` (none | selective | full), in place. Returns the number of
    blocks changed. Parameters, names and state_dict are untouched; calling again switches the mode ("none"
    restores the plain forward)."""
    if mode not in MODES:
        raise ConfigError(f"recompute mode {mode!r} is not one of {', '.join(MODES)}")
    changed = 0
    for block in model.modules():
        if not isinstance(block, _block_types()) or recompute_mode(block) == mode:
            continue
        if mode == "none":  # back to the forward it had before: drop the instance attributes
            orig = block.__dict__.pop(_ORIG)
            del block.__dict__[_MODE], block.__dict__["forward"]
            if getattr(orig, "__func__", None) is not type(block).forward:
                block.forward = orig  # someone else's instance-level forward, installed before ours
        else:
            if not hasattr(block, _ORIG):
                object.__setattr__(block, _ORIG, block.forward)  # a bound method: deepcopy rebinds it to the copy
                block.forward = types.MethodType(_recompute_forward, block)
            object.__setattr__(block, _MODE, mode)
        changed += 1
    return changed


def measure(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> dict[str, int]:
    """Memory of one training step of `model(idx, targets)`, counted op by op (minite.bytecount.PeakBytes):

    held   bytes of the tensors the forward leaves alive for the backward (saved activations, SAC's cache, the
           logits and loss), i.e. what recompute shrinks; parameters, buffers and inputs are not counted
    peak   the most bytes alive at once during forward + backward (recompute buffers and gradients included)

    Not ``minite.bytecount.saved_bytes``: a saved-tensor-hook counter sees only what the checkpoint itself saves
    (each block's input), not SAC's cache (kept by a dispatch mode), so it would report selective as full.
    """
    from minite.bytecount import PeakBytes
    pb = PeakBytes()
    # Mark the model's own storages as seen: a view of a weight (w.t() inside F.linear) is not a new tensor.
    pb.live.update(t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers()))
    with pb:
        _, loss = model(idx, targets)
        held = pb.now
        loss.backward()
        del loss
    return {"held": held, "peak": pb.peak}
