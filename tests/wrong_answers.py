"""Issue 21: every exercise's checks against a deliberately wrong answer: no check may pass.

Each answer below is the solution's own region with one plausible learner's mistake planted in it (an off-by-one
mask, a missing scale, a forgotten gradient term, the wrong stride...), written as (old, new) edits of the
solution's region text; a plain string replaces the whole region. Every task of a chapter is wrong at once, so a
chapter costs one grading run (plus the solution's reference run, cached per process) and must score 0/n, every
task failing. A later task's check may also call an earlier task's function (05's backward check runs the forward
kernel, 04's to_halves_layout uses halves_permutation): so each mistake was also graded alone, the chapter's other
tasks solved, when this table was written, and its own check failed every time.
The distributed chapters (10-13 launch torchrun) are marked slow. Chapter 14's table is in test_check_notebooks.py.
The test is test_grading.py's test_wrong_answers_pass_no_check: in that file it runs in the process (pytest-xdist
--dist loadfile) whose cache already holds each solution's reference run.
"""
from __future__ import annotations

from pathlib import Path

import nbformat

from minite.grading import STUB, regions, task_cells

ROOT = Path(__file__).resolve().parent.parent

# chapter -> task -> list of edits: (old, new) replaces the one occurrence of `old` in the task's regions;
# a str is a whole region's new body (regions in order; a region without one keeps the solution's body).
WRONG: dict[str, dict[str, list]] = {
    "00_triton_from_zero": {
        "transpose_kernel": [("pid_m = tl.program_id(0)", "pid_m = tl.program_id(1)"),  # grid axes swapped
                             ("pid_n = tl.program_id(1)", "pid_n = tl.program_id(0)")],
        "log_softmax_kernel": [('mask=inside, other=-float("inf")', "mask=inside, other=0.0")],  # padding counts
        "online_softmax_kernel": [("d = d * tl.exp(m - shift) +", "d = d +")],  # old sum never rescaled
        "matmul_bias_relu_kernel": [("out = tl.maximum(acc + bias[None, :], 0.0)", "out = acc + bias[None, :]")],
    },
    "01_floating_point": {
        "decode_fp16": [("v = 2.0 ** -14 * (m / 1024)", "v = 2.0 ** -15 * (1 + m / 1024)")],  # subnormal as normal
        "stochastic_round_bf16": [("((u + r) >> 16)", "(u >> 16)")],  # truncation: round toward zero
        "kahan_sum_fp16": [("y = v - comp", "y = v")],  # compensation never applied
        "update_scale": [("growth_tracker = 0\n        hysteresis_tracker -= 1", "hysteresis_tracker -= 1")],
    },
    "02_fp8": {
        "delayed_scaling_update": [(" / 2.0 ** margin", "")],  # margin forgotten
        "quantize_kernel": [("y = x * tl.load(Scale_ptr)", "y = x / tl.load(Scale_ptr)")],  # scale inverted
        "block_scaled_matmul_kernel": [("raw * (sa[:, None] * sb[None, :])", "raw * sa[:, None]")],  # B's scale lost
    },
    "03_rmsnorm": {
        "layernorm_fwd_kernel": [("centred = tl.where(inside, xs - mu, 0.0)", "centred = xs - mu")],  # pad lanes
        "layernorm_backward": [(" - xhat * (g * xhat).mean(-1, keepdim=True)", "")],  # forgotten gradient term
        "layernorm_bwd_kernel": [("sum_dw += grad_y * xhat", "sum_dw += grad_y * xs")],  # x for x-hat
    },
    "04_rope": {
        "rope_interleaved_kernel": [("(a * c - bb * s)", "(a * c + bb * s)")],  # sign of the rotation
        "halves_permutation": ["    return torch.cat([torch.arange(1, D, 2), torch.arange(0, D, 2)])"],
        "to_halves_layout": ["    return w_q[halves_permutation(w_q.shape[0]).to(w_q.device)]"],  # not per head
    },
    "05_swiglu": {
        "gelu_grad": [("return cdf + g * pdf", "return cdf")],  # forgotten term of the product rule
        "geglu_dropout_fwd_kernel": [("act / (1.0 - p)", "act")],  # dropout without the 1 / (1 - p) scale
        "geglu_dropout_bwd_kernel": [("(grad * b * (cdf + a * pdf))", "(grad * b * cdf)")],
    },
    "06_cross_entropy": {
        "label_smoothing_grad": [("keep.sum().clamp(min=1)", "len(target)")],  # mean over ignored rows too
        "zloss_ce_kernel": [("(1.0 + 2.0 * z_coef * lse)", "1.0")],  # z-loss's gradient term forgotten
        "vocab_parallel_ce": [("start += s.shape[1]", "start += s.shape[0]")],  # shard offset along the wrong axis
    },
    "07_flash_attention": {
        "gqa_reference": [(" / math.sqrt(D)", "")],  # missing softmax scale
        "pack_thd": [("[0] + list(lengths)", "list(lengths)")],  # cu_seqlens without its leading 0
        "bwd_atomic_kernel": [("input_precision=\"ieee\") * sm_scale  # (BLOCK_M, D)",
                               "input_precision=\"ieee\")  # (BLOCK_M, D)")],  # dq's scale forgotten
    },
    "08_kv_cache": {
        "max_context_tokens": [("per_token = 2 * n_layer", "per_token = n_layer")],  # v forgotten (k only)
        "lse_merge_kernel": [("m + tl.log(tot)", "tl.log(tot)")],  # the shift left out of the merged LSE
        "generate_ragged": [(", lengths=[len(p) for p in prompts])", ")")],  # padding read as prompt
    },
    "09_lora": {
        "lora_grads": [("dB = s * dy32.t() @ g", "dB = dy32.t() @ g")],  # missing scale
        "lora_dadb_kernel": [("(s * db)", "db")],
        "lora_merge_kernel": [("(w + s * ba)", "(w - s * ba)")],  # sign
        "extract_lora": [("B = U[:, :r] * root / s", "B = U[:, :r] * root")],  # the layer's scale not undone
    },
    "10_data_parallel": {
        "sharded_sgd_step": [("lr * (shard / W)", "lr * shard")],  # reduce-scatter's sum taken for the mean
        "adamw_shard_kernel": [("tl.sqrt(v) / tl.sqrt(bc2)", "tl.sqrt(v)")],  # v's bias correction forgotten
    },
    "11_tensor_parallel": {
        "vocab_parallel_embedding": [(" * mine[..., None]  #", "  #")],  # rows of tokens I do not own kept
        "sp_rmsnorm": [("return all_reduce(grad)", "return grad")],  # the weight's gradient never all-reduced
    },
    "12_pipeline_parallel": {
        "balanced_cuts": [(" + (last_ms if k == p - 1 else 0.0)", "")],  # the head and loss forgotten
        "interleaved_1f1b": [("(v - 1 - c if backward else c)", "c")],  # backwards walk the chunks forwards
        "zbh1_ops": [("if k >= stage:", "if k >= 0:")],  # W right after every B: a bubble of 2(p-1), not p-1
    },
    "13_context_parallel": {
        "ring_step_merge": [("o_run = (o_run * e_run[..., None] + o_b * e_b[..., None]) / (e_run + e_b)[..., None]",
                             "o_run = o_run * e_run[..., None] + o_b * e_b[..., None]")],  # not renormalised
        "ring_block_update_kernel": [("acc = acc * corr[:, None] +", "acc = acc +")],  # old rows not rescaled
        "heads_to_seq": [("return got.transpose(0, 1).reshape(", "return got.reshape(")],  # the rank axis read
        #                                                             as heads in place: right only at B = 1
    },
    "15_fp8_at_scale": {
        "mx_scale_bits": [("exp.long() - 1 - emax_elem", "exp.long() - emax_elem")],  # floor(log2) off by one
        "quantize_1x128_kernel": [("tl.program_id(1), inv, mask=r < R)", "tl.program_id(1), s, mask=r < R)")],
        "mx_matmul_kernel": [("prod * fa[:, None] * fb[None, :]", "prod * fa[:, None]")],  # B's scales lost
    },
    "16_moe": {
        "sigmoid_router": [("picked = scores.gather(1, chosen)",  # weights from the biased scores
                            "picked = (scores + bias.float()).gather(1, chosen)")],
        "seq_balance_loss": [("f = hits * E / (k * T)", "f = hits * E / T")],  # top-k's k forgotten
        "permutation": [("order = torch.empty_like(dest)\n    order[dest] = torch.arange(dest.numel(), "
                         "device=dest.device)", "order = dest.clone()")],  # the inverse taken for the permutation
        "grouped_gemm_dw_kernel": [("DW_ptr + e * K * N +", "DW_ptr + e * K +")],  # wrong stride between experts
    },
}


def wrong_answers(solution_nb, table: dict[str, list]) -> dict[str, list[str]]:
    """task -> the region bodies of the solution with the table's mistakes planted (each edit used once)."""
    out = {}
    for name, i in task_cells(solution_nb).items():
        lines = solution_nb.cells[i].source.splitlines()
        bodies = ["\n".join(lines[b + 1:e]) for b, e in regions(solution_nb.cells[i].source, name)]
        whole = [x for x in table[name] if isinstance(x, str)]
        bodies = whole + bodies[len(whole):]
        for old, new in (x for x in table[name] if not isinstance(x, str)):
            hits = [k for k, body in enumerate(bodies) if old in body]
            assert len(hits) == 1 and bodies[hits[0]].count(old) == 1, f"{name}: {old!r} is not in one place"
            bodies[hits[0]] = bodies[hits[0]].replace(old, new)
        out[name] = bodies
    return out


def student_notebook(exercise_nb, answers: dict[str, list[str]]):
    """The exercise with each stub replaced by its answer (bodies keep the solution's indentation)."""
    nb = nbformat.from_dict(exercise_nb)
    for cell in nb.cells:
        todo = list(answers.get(cell.get("metadata", {}).get("minite", {}).get("task"), []))
        if todo:
            lines = cell.source.splitlines()
            cell.source = "\n".join(todo.pop(0) if ln.strip() == STUB else ln for ln in lines)
            assert not todo, "one answer per region"
    return nb


DISTRIBUTED = {"10_data_parallel", "11_tensor_parallel", "12_pipeline_parallel", "13_context_parallel"}  # torchrun

