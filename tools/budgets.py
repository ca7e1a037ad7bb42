"""Line budgets (DESIGN.md §2) over every file of the library, and the longest function of the training loop.

A file matches the first rule whose pattern fits it; every file of minite/ matches one (the last rule is the
default). Raise a budget where a concept needs the lines: never pack code onto fewer lines to meet one.
"""
import ast
import sys
from pathlib import Path

root = Path(__file__).resolve().parent.parent
RULES = [
    # Concept files register their own torch.compile ops (issue 22: no side file); these three need the lines.
    # forward, dK/dV and dQ kernels, varlen, 2 ops + their autograd formula; issue 25: the reference's clean-up of
    # non-finite masked K/V (_finite_kv) and the scale / D checks; the kernels' own clean-up of the diagonal key
    # blocks (_fwd_block and _dq_block: the loop bodies as helpers, a branch, a spelling per dot kind: +45)
    # issue 33: per-tensor strides (no layout copies), split main / masked loops in all three kernels, per-kernel
    # GPU tiles, and the GPT's fused-qkv op pair (RoPE + attention, one d(qkv) buffer) with its autograd: +230
    ("minite/kernels/attention.py", 780),
    ("minite/kernels/cross_entropy.py", 335),  # CE and the fused linear-CE: 3 ops, 2 autograd formulas, +inf rule
    # RMSNorm and LayerNorm: 4 ops, 2 autograd formulas, typed device/dtype; issue 33: the backward's register
    # budget at wide rows (partials first, one fused LayerNorm reduction, db on the host past 8192 columns): +20
    ("minite/kernels/rmsnorm.py", 340),
    # bit specs, reference + Triton encode/decode, typed public API; issue 35: the scale format E8M0 (ScaleSpec)
    # in the same language: its spec, reference and Triton encode/decode
    ("minite/formats/specs.py", 405),
    ("minite/hf.py", 540),                   # Llama <-> GPT mapping, the layer swap, padded batches, the MoE refusal;
    # issue 37: untied heads both ways, Mistral/Qwen2, per-op switches with HF's fallbacks, class patching (+190)
    # resolve, build, step, loop, the CLI, their checks; a statement a line; the TensorBoard writer (issue 26) and the
    # MoE routing in the log line (chapter 16); the default preset from the rank's device; sampling in eval mode;
    # (issue 35) the loss-free balance's explicit bias step at the optimizer step, and its import; (issue 32) compile
    # time apart from the steady state: the timed calls, the "compiling" notice, the closing line's fields; (issue 37)
    # --help with the run's preset values, a section-less flag's hint, the start line's non-defaults (MoE, FP8 and
    # whether emulated, layout, recompute, TensorBoard) and TensorBoard's grouped tags; (issue 33) on a GPU, the line
    # saying which implementation runs each op, and why (minite/choices.py)
    ("minite/train.py", 698),
    ("minite/models/gpt.py", 330),           # the GPT and (chapter 16) its MoE blocks: config, balance loss, stats
    # the sm_90/sm_80 gate: record with the JIT's specialisation, capture a GPU's launches, compile, ptxas (cached),
    # read the sm_90 build (wgmma, replicated layouts, fp8 promotion intervals), report (issue 32)
    ("minite/gpu_compile.py", 690),
    ("minite/gpu_examples.py", 300),         # one function per kernel family: its launches at the benchmarks' shapes
    ("minite/data.py", 360),                 # corpus preparation: registry, user file, tokenizers, batches, lock
    # five sections, each field's doc and its check; sub-section keys; chapter 15: --fp8.recipe / --fp8.min_dim;
    # issue 38: --parallel.cp_mode / cp_a2a and their checks
    ("minite/config.py", 365),
    # chapter 15: three quantize configurations and the block-scaled GEMM, and the linear layer's autograd Function
    # for the block recipes (its three GEMMs each scale along their own K)
    # + the two custom ops for torch.compile (block_quantize, block_scaled_mm); issues 32/33: the MX GEMM as its own
    # kernel (bf16 MMA on exactly dequantized slabs), the interpreter's exact fp8 decode, the stated promotion
    ("minite/kernels/fp8_block.py", 450),
    # issue 22 wrote the parallel files one statement a line (nanoGPT's style) instead of packing them:
    ("minite/parallel/tensor.py", 330),      # TP layers, vocab-parallel CE, the SP column linear (from sequence.py)
    ("minite/parallel/context.py", 300),     # ring and all-gather attention, forward and backward
    # DDP and ZeRO-1/2/3 in one class, its constructor in named steps; chapter 16: the parameters it owns and the
    # gradient divisor (ep x ZeRO: a second one over edp for the experts), gathered() for a whole-model read
    ("minite/parallel/data.py", 295),
    # every collective (EP's all-to-all too), the global-norm clip of shards; issue 38: Ulysses' seq<->heads pair
    ("minite/parallel/comm.py", 375),
    # LoRALinear, PEFT's API, (issue 25) its argument / merged-state checks, (issue 36) the merged-backward guard
    ("minite/layers/lora.py", 325),
    # issue 33: three kernels instead of one (the skinny x A^T, the GEMM with the adapter K-step, the row-split
    # dA / dB reduction), their three launchers and per-kernel GPU tiles
    ("minite/kernels/lora.py", 330),
    # every group of every layout: the grid's lines, ep, edp, edp_cp (16); issue 38: hybrid CP's a2a / ring groups
    # and the Ulysses head check of check_layout
    ("minite/parallel/dims.py", 290),
    # the schedules' runner, (16) a MoE inside the stages, (01) fp16's S; issue 38: ZB-H1's B and W steps, the
    # interleaved schedule's model chunks (Chunks, ops by chunk, forward-only chunk by chunk, their checks)
    ("minite/parallel/pipeline.py", 310),
    ("minite/parallel/expert.py", 300),      # EP's dispatch, its gradient averaging under dp/cp/tp, ZeRO's and pp's
    ("minite/parallel/*.py", 250),
    ("minite/parallel/workers/*.py", 260),   # the torchrun workers, a file per chapter: checks, measurements, task
    ("minite/**/*.py", 300),
]
# Functions that must read top to bottom (issue 22: no function of the training loop over 60 lines).
FUNCTION_RULES = [("minite/train.py", 60)]


def main() -> int:
    seen, over = set(), []
    for pattern, limit in RULES:
        for f in sorted(root.glob(pattern)):
            if f in seen or "__pycache__" in f.parts:
                continue
            seen.add(f)
            n = len(f.read_text().splitlines())
            if n > limit:
                over.append(f"{f.relative_to(root)}: {n} lines > {limit}")
    for pattern, limit in FUNCTION_RULES:
        for f in sorted(root.glob(pattern)):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        over.append(f"{f.relative_to(root)}:{node.lineno} {node.name}(): {n} lines > {limit}")
    print("line budgets: " + ("; ".join(over) if over else f"ok ({len(seen)} files)"))
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
