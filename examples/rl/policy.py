"""The trainer's policy: a Hugging Face causal LM in plain torch (or, with a LoRA rank, that model
frozen under a PEFT LoRA adapter that alone trains), the logprobs it gives tern's sampled tokens,
the GRPO loss (PPO-clip with the importance ratio against tern's logprobs), and an AdamW step.

In bfloat16 the model computes in bfloat16 like the server, while AdamW updates float32 master
weights that are rounded back into the model after each step: Adam's small steps would otherwise
vanish in bfloat16's 8-bit mantissa. A LoRA adapter needs no master copy: PEFT keeps its weights in
float32 over a bfloat16 base. The weights pushed to tern are always the model's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM

CLIP_EPS = 0.2
MAX_GRAD_NORM = 1.0
# Every projection of the decoder blocks (PEFT's module names; tern serves adapters on all of them).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Batch:
    """Right-padded prompt + completion sequences, and where the completion tokens are."""

    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64
    prompt_lens: list[int]
    completion_lens: list[int]


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> Batch:
    seqs = [p + c for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return Batch(input_ids, mask, [len(p) for p in prompts], [len(c) for c in completions])


class Policy:
    def __init__(
        self,
        model_path: str,
        dtype: torch.dtype,
        lr: float,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
    ) -> None:
        """With `lora_rank`, `model` is a PEFT model: the base frozen, a LoRA adapter (B = 0, so
        the policy starts as the base) on every projection of LORA_TARGETS."""
        self.model: nn.Module = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        # NOTE: PEFT wraps the model but injects its LoRA layers in place, into the modules of
        # `self.lm`: a forward through `self.lm` runs the adapter.
        self.lm: nn.Module = self.model
        self.is_lora = lora_rank is not None
        if lora_rank is not None:
            from peft import LoraConfig, get_peft_model  # noqa: PLC0415 - only LoRA runs need it

            alpha = lora_alpha if lora_alpha is not None else 2 * lora_rank
            config = LoraConfig(r=lora_rank, lora_alpha=alpha, target_modules=LORA_TARGETS,
                                lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")  # fmt: skip
            self.model = get_peft_model(self.model, config)
            self.lm = self.model.get_base_model()
        self.model.eval()  # no dropout: the trainer's forward must be the sampler's distribution
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = None
        if any(p.dtype != torch.float32 for p in self.params):
            self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        trained = self.master if self.master is not None else self.params
        self.optimizer = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """What tern loads as its weights: every parameter once (a tied LM head is the embedding);
        with LoRA, the frozen base's, under their checkpoint names (no adapter)."""
        weights = {}
        for name, p in self.lm.named_parameters():
            if ".lora_" not in name:  # PEFT renames a wrapped layer's own weight base_layer.*
                weights[name.replace(".base_layer.", ".")] = p.detach()
        return weights

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors under PEFT's names: what a push of the adapter sends."""
        from peft import get_peft_model_state_dict  # noqa: PLC0415 - only LoRA runs need it

        return {name: t.detach() for name, t in get_peft_model_state_dict(self.model).items()}

    def token_logprobs(self, batch: Batch) -> list[torch.Tensor]:
        """Each sequence's completion-token logprobs, (C_i,) float32, with grad when enabled.

        Only the completion positions go through the LM head: (tokens, vocab) logits for the
        prompts would cost more than the rest of the model.
        """
        hidden = self.lm.model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask
        ).last_hidden_state  # (B, T, H)
        rows, targets = [], []
        for i, (p, c) in enumerate(zip(batch.prompt_lens, batch.completion_lens)):
            rows.append(hidden[i, p - 1 : p + c - 1])  # position t predicts token t + 1
            targets.append(batch.input_ids[i, p : p + c])
        logits = self.lm.lm_head(torch.cat(rows)).float()  # (sum C_i, V)
        chosen = logits.log_softmax(-1).gather(1, torch.cat(targets)[:, None]).squeeze(1)
        return list(chosen.split(batch.completion_lens))

    def step(self) -> float:
        """Clips the gradient, takes an AdamW step, zeroes the gradient; returns the grad norm."""
        if self.master is not None:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
        trained = self.master if self.master is not None else self.params
        norm = float(torch.nn.utils.clip_grad_norm_(trained, MAX_GRAD_NORM))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        if self.master is not None:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
        return norm


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO: each reward against its group's (same prompt's) mean, over the group's std."""
    groups = rewards.view(-1, group_size)  # (prompts, n)
    mean = groups.mean(1, keepdim=True)
    std = groups.std(1, keepdim=True)
    return ((groups - mean) / (std + 1e-4)).view(-1)


def grpo_loss(
    new_logprobs: list[torch.Tensor],
    old_logprobs: list[torch.Tensor],
    advantages: torch.Tensor,
    normalizer: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate summed over tokens and divided by a constant (samples x max tokens,
    as Dr. GRPO), so that neither long nor short completions get a per-token weight of their own.

    The ratio is against tern's logprobs: with one optimizer step per batch the trainer's policy
    equals the sampler's, and the ratio departs from 1 only by the training-inference mismatch.
    """
    loss = torch.zeros(())
    ratios, clipped = [], []
    for new, old, adv in zip(new_logprobs, old_logprobs, advantages.tolist()):
        ratio = torch.exp(new - old)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * adv)
        loss = loss - surrogate.sum()
        ratios.append(ratio.detach())
        clipped.append(((ratio - 1).abs() > CLIP_EPS).detach())
    ratio_all = torch.cat(ratios)
    stats = {
        "ratio_mean": float(ratio_all.mean()),
        "ratio_max": float(ratio_all.max()),
        "clip_frac": float(torch.cat(clipped).float().mean()),
    }
    return loss / normalizer, stats
