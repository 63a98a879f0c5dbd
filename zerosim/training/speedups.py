"""What makes the policy update cheaper without changing what it computes (up to float rounding):

- micro-batches grouped by length and trimmed to their own longest row (:func:`group_by_length`);
- on CPU, a log-prob head that projects only the positions the loss scores (:func:`compact_log_prob_head`);
- on a CPU that multiplies bf16 in hardware (AMX, AVX512_BF16), the update under bf16 autocast where no loss
  term compares two passes (:func:`cpu_autocast_bf16`).

:class:`zerosim.training.trainer.SearchTrainer` applies them; ``benchmarks/update.py`` measures each.
"""

from __future__ import annotations

from typing import Any

import torch

# -- the update's micro-batches ------------------------------------------------------------------------------
# TRL pads every row of a generation batch to the batch's longest prompt (left) and completion (right), shuffles
# the rows and slices them into micro-batches that keep that width. ``group_by_length`` puts rows of similar
# length together and cuts each micro-batch to its own longest row, so the forward and backward stop computing
# padding. The rows stay in the same optimizer step, and the loss types below weight a row the same whichever
# micro-batch it is in (equal-sized micro-batches): the summed gradient is the same up to float rounding.
PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # (B, P), left-padded
COMPLETION_KEYS = (  # (B, T), right-padded, when 2-D; (B,) advantages and (B, 1) sequence ratios are kept
    "completion_ids",
    "completion_mask",
    "tool_mask",
    "advantages",
    "old_per_token_logps",
    "ref_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
)
BATCH_KEYS = ("num_items_in_batch",)  # 0-d: the whole generation batch's
# grpo: mean over rows of each row's token mean, / accumulation steps; dr_grpo: sum / (rows x
# max_completion_length), / accumulation steps; dapo: sum / the generation batch's token count. Not bnpo (a
# token mean per micro-batch: it changes with the grouping).
GROUPABLE_LOSSES = ("grpo", "dr_grpo", "dapo")


def merge_rows(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """TRL's micro-batches of one generation batch (same widths) back into one batch, rows in order."""
    merged = {}
    for key, first in chunks[0].items():
        if first is None or (isinstance(first, torch.Tensor) and first.ndim == 0):
            merged[key] = first
        elif isinstance(first, torch.Tensor):
            merged[key] = torch.cat([chunk[key] for chunk in chunks])
        else:
            merged[key] = [row for chunk in chunks for row in chunk[key]]
    return merged


def select_rows(batch: dict[str, Any], rows: torch.Tensor) -> dict[str, Any]:
    """``batch`` with only ``rows`` (indices, in that order); batch-level values kept."""
    out = {}
    for key, value in batch.items():
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            out[key] = value
        elif isinstance(value, torch.Tensor):
            out[key] = value[rows.to(value.device)]
        else:
            out[key] = [value[i] for i in rows.tolist()]
    return out


def trim_padding(batch: dict[str, Any]) -> dict[str, Any]:
    """``batch`` without the prompt columns (left) and completion columns (right) that no row uses.

    Dropping a left-padding column shifts every position of the batch by one; rotary position embeddings see
    only position differences, so the log-probs are the same up to float rounding.
    """
    used = batch["prompt_mask"].any(0).nonzero()
    first = int(used[0]) if len(used) else batch["prompt_mask"].shape[1] - 1
    used = batch["completion_mask"].any(0).nonzero()
    width = batch["completion_mask"].shape[1]
    end = int(used[-1]) + 1 if len(used) else 1
    out = dict(batch)
    for key in PROMPT_KEYS:
        out[key] = batch[key][:, first:]
    for key in COMPLETION_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == width:
            out[key] = value[:, :end]
    return out


def group_by_length(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``chunks`` (one generation batch in TRL's micro-batches) sorted by length (prompt +
    completion tokens; ties keep their order) and cut into as many micro-batches of the same size, each
    trimmed to its own longest row. Every value of a row (advantage, masks, log-probs) moves with it."""
    batch = merge_rows(chunks)
    lengths = batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)
    order = torch.sort(lengths.cpu(), stable=True).indices
    size = len(order) // len(chunks)
    return [trim_padding(select_rows(batch, order[i * size : (i + 1) * size])) for i in range(len(chunks))]


def groupable(batch: dict[str, Any]) -> bool:
    """Whether every value of ``batch`` is one that :func:`group_by_length` knows how to move and trim."""
    known = {*PROMPT_KEYS, *COMPLETION_KEYS, *BATCH_KEYS}
    return set(batch) <= known and "prompt_mask" in batch and "completion_mask" in batch


def cpu_autocast_bf16(setting: bool | None, compares_passes: bool = False, cpu: bool | None = None) -> bool:
    """Whether the update runs under SearchTrainer's bf16 autocast, for ``trainer.bf16``: True, False, or None
    (auto): as the process computes on CPU (``cpu``; None: :func:`zerosim.core.runtime.cpu_bf16`, from
    ``runtime.bf16`` — on where the CPU multiplies bf16 in hardware, AMX or AVX512_BF16), unless the loss
    compares log-probs of two passes (``compares_passes``: a KL to the reference, a reused batch's old log-probs)
    — bf16 rounds each pass differently (0.06 nats per token on the policy's own samples), which a ratio or a KL
    would read as a difference of policies. With a GPU: never (TRL's own bf16 applies)."""
    if torch.cuda.is_available() or setting is False:
        return False
    if setting is None:
        if cpu is None:
            from zerosim.core.runtime import cpu_bf16

            cpu = cpu_bf16()
        return bool(cpu) and not compares_passes
    return True


def machine_line(cfg, cpuinfo: str | None = None) -> str:
    """``machine: <CPU kind or GPU> · <bf16|fp32> compute (runtime.bf16=...: why): generation ..., update ...``:
    what this machine computes the job in, and why (at start and in the dry run). ``cpuinfo``: for tests."""
    from zerosim.core.runtime import bf16_units, cpu_kind, decide_precision

    t = cfg.trainer
    setting = {None: "auto", True: "true", False: "false"}[t.bf16]
    if torch.cuda.is_available():
        return f"machine: {torch.cuda.get_device_name()} (CUDA) · trainer.bf16={setting} (the GPU recipe's precision)"
    cpu = decide_precision(cfg.runtime.bf16, bf16_units(cpuinfo))
    bf16 = cpu_autocast_bf16(t.bf16, compares_passes=t.beta != 0, cpu=cpu.bf16)
    if setting != "auto":
        why = "as set"
    elif bf16 or not cpu.bf16:
        why = "as runtime.bf16"
    else:
        why = "trainer.beta != 0: a KL term compares two passes, which bf16 rounds differently"
    update = f"update in {'bf16 autocast' if bf16 else 'fp32'} (trainer.bf16={setting}: {why})"
    generation = f"generation in {'bf16 (hi+lo weights)' if cpu.generation else 'fp32'}"
    kind = cpu_kind(cpuinfo)
    return f"machine: {kind} · {'bf16' if cpu.bf16 else 'fp32'} compute ({cpu.why}; fp32 weights): {generation}, {update}"


# -- the log-prob head: only the positions that are scored -----------------------------------------------------
# TRL's fused LM head (``add_fused_lm_head``) projects only the positions with a label on CUDA, but every
# position elsewhere (prompt and padding included), and TRL labels every completion token, the
# ``<information>`` blocks too. On CPU the head was ~40% of the update. ``compact_log_prob_head`` wraps the
# fused forward: off CUDA/XPU it projects only the labelled positions and, in the loss's own pass, only the
# positions in the loss mask (what ``scored()`` returns); the others read 0, as TRL's unlabelled ones do.
LOGIT_SCALES = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


def compact_log_prob_head(model, temperature: float, outputs: tuple[str, ...], scored, enabled) -> bool:
    """Wrap ``model``'s fused forward (TRL's) so that off CUDA/XPU, while ``enabled()``, it scores only the
    labelled positions, and of the last ``T`` only those where ``scored()`` (a ``(B, T)`` bool tensor, or None)
    is true. Returns False and leaves the model alone when its head scales or caps its logits (TRL's forward
    handles those)."""
    import functools
    import types

    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer import utils as trl_utils

    text = model.config.get_text_config()
    from accelerate.utils import is_peft_model

    if is_peft_model(model) or any(getattr(text, name, None) is not None for name in LOGIT_SCALES):
        # a PeftModel: TRL patched the model under it (wrap that, as SearchTrainer does); scaled or capped
        # logits: TRL's forward knows them
        return False
    chunk = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)
    fused = model.forward  # TRL's fused forward, bound to the model

    @functools.wraps(type(model).forward)  # generate validates its kwargs against this signature
    def forward(self, *args, fused_lm_head=False, labels=None, num_items_in_batch=None, **kwargs):
        on_gpu = labels is not None and labels.device.type in ("cuda", "xpu")
        special = "shift_labels" in kwargs or kwargs.get("output_router_logits")
        if not fused_lm_head or labels is None or on_gpu or special or not enabled():
            return fused(
                *args,
                fused_lm_head=fused_lm_head,
                labels=labels,
                num_items_in_batch=num_items_in_batch,
                **kwargs,
            )
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        targets = labels[:, 1:]
        keep = scored()
        if keep is not None and keep.shape[0] == targets.shape[0] and keep.shape[1] <= targets.shape[1]:
            T = keep.shape[1]
            targets = torch.cat(
                [targets[:, :-T], targets[:, -T:].masked_fill(~keep.to(targets.device), -100)], 1
            )
        mask = targets != -100
        head = self.get_output_embeddings()
        # under autocast the head still projects in fp32 (as TRL's cast_lm_head_to_fp32): a bf16 logit of
        # magnitude 20 is rounded to 1/8; with only the loss's positions projected this costs ~3% of the update
        positions = hidden[mask].float()
        with (
            trl_utils.maybe_gather_lm_head_ctx(head.weight, head.bias),
            torch.autocast(hidden.device.type, enabled=False),
        ):
            values = ChunkedLogProbFunction.apply(
                positions, head.weight, head.bias, targets[mask], temperature, chunk, None, 1.0, outputs
            )
        log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = (
            None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in values
        )
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return trl_utils.FusedCausalLMOutput(
            loss=-log_probs.sum() / count,
            log_probs=log_probs,
            entropy=entropy,
            log_sum_sq_probs=log_sum_sq_probs,
            mean_logits=mean_logits,
            is_top1=is_top1,
            label_mask=mask,
        )

    model.forward = types.MethodType(forward, model)
    return True
