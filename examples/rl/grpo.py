"""GRPO on a CPU with tern doing every rollout: the trainer (this process, plain torch) samples
n completions per prompt from tern with token ids and logprobs, scores them, takes one
policy-gradient step, and pushes the new weights into tern before the next rollouts.

    python examples/rl/grpo.py                          # launches tern on the default model
    python examples/rl/grpo.py --weight-sync shm        # weights through /dev/shm, not a broadcast
    python examples/rl/grpo.py --colocate               # tern sleeps (level 2) while training
    python examples/rl/grpo.py --quantization int4      # tern serves int4 weights (pushed float)
    python examples/rl/grpo.py --lora 16                # trains and pushes only a LoRA adapter
    python examples/rl/grpo.py --batch-invariant        # rollouts independent of their batch
    python examples/rl/grpo.py --base-url http://127.0.0.1:8000 --model DIR   # attach instead

Step k: rollouts from the weights of step k (tern's weight_version says so), the trainer's own
logprobs of those tokens (their distance from tern's is the training-inference mismatch), one
AdamW step, then the push. One more rollout after the last push scores the final weights. With
--lora the base stays frozen on both sides: tern serves the adapter as model "policy", its
lora_version says which step's adapter sampled, and each push sends the adapter alone. The
task is examples/rl/task.py; what a run found is in docs/rl.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from policy import Policy, group_advantages, grpo_loss, make_batch
from report import format_step, machine_info, plot, push_summary, write_log
from task import Prompt, count_words, is_exact, reward, sample_prompts
from tern_server import Rollout, WeightSync, greedy, launch, sample
from transformers import AutoTokenizer

from frontend.client.trainer import TrainerClient

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHORT = {"steps": 2, "prompts_per_step": 2, "samples_per_prompt": 4, "max_new_tokens": 8}
PROBE_PROMPTS = [Prompt("the sea", 3), Prompt("cats", 2)]  # greedy outputs before and after
PROBE_TOKENS = 8
LR, LORA_LR = 2e-5, 1e-3  # a LoRA adapter's few weights need far larger steps than the model's
ADAPTER = "policy"  # the name tern serves the LoRA adapter under (the requests' model)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF model directory (default: tern's default)")
    p.add_argument("--base-url", default=None, help="attach to a running tern instead")
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--prompts-per-step", type=int, default=4)
    p.add_argument("--samples-per-prompt", type=int, default=8, help="GRPO's group size")
    p.add_argument("--lr", type=float, default=None,
                   help=f"default {LR}, with --lora {LORA_LR}")  # fmt: skip
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="the server's and the trainer's")  # fmt: skip
    p.add_argument("--quantization", choices=["int8", "int4"], default=None,
                   help="tern's weights quantized at load and on every push (the trainer's stay "
                   "--dtype): the mismatch then includes the quantization")  # fmt: skip
    p.add_argument("--weight-sync", choices=["distributed", "shm"], default="distributed",
                   help="distributed: a broadcast over a process group the trainer joins; shm: "
                   "safetensors files in /dev/shm (with --lora: the adapter's safetensors bytes "
                   "over HTTP)")  # fmt: skip
    p.add_argument("--colocate", action="store_true", help="tern sleeps while the trainer steps")
    p.add_argument("--lora", type=int, default=None, metavar="RANK",
                   help="train a LoRA adapter of this rank on every projection (the base frozen) "
                   "and push only the adapter; tern serves it as model 'policy'")  # fmt: skip
    p.add_argument("--lora-alpha", type=float, default=None, help="default 2 x --lora")
    p.add_argument("--batch-invariant", action="store_true",
                   help="tern's --batch-invariant: each rollout's tokens and logprobs the same "
                   "whatever else it was batched with (float32 only)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=Path("rl-run"))
    p.add_argument("--plot", type=Path, default=None, help="default: OUT_DIR/rl.png")
    p.add_argument("--short", action="store_true", help="CI mode: " + str(SHORT))
    args = p.parse_args(argv)
    if args.short:  # the short defaults, unless given explicitly
        p.set_defaults(**SHORT)
        args = p.parse_args(argv)
    if args.lora is not None:
        if args.lora < 1:
            p.error("--lora takes a rank >= 1")
        if args.colocate:  # level-2 sleep drops the base weights, which a LoRA run never pushes
            p.error("--colocate refills tern's weights with a full push each step; with --lora "
                    "only the adapter is pushed, so the two do not combine")  # fmt: skip
        if args.lora_alpha is None:
            args.lora_alpha = 2.0 * args.lora
    elif args.lora_alpha is not None:
        p.error("--lora-alpha needs --lora")
    if args.lr is None:
        args.lr = LORA_LR if args.lora else LR
    if args.model is None:
        from frontend.model_prep import ensure_default_model

        args.model = str(ensure_default_model())
    args.plot = args.plot or args.out_dir / "rl.png"
    return args


def encode(tokenizer: Any, prompt: Prompt) -> list[int]:
    ids = tokenizer.apply_chat_template(
        prompt.messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return list(ids)


def rollout_stats(prompts: list[Prompt], rollouts: list[Rollout], seconds: float) -> dict:
    rewards = [reward(prompts[r.prompt_index], r.text) for r in rollouts]
    num_tokens = sum(len(r.token_ids) for r in rollouts)
    return {
        "rewards": rewards,
        "target_words": [prompts[r.prompt_index].num_words for r in rollouts],
        "words": [count_words(r.text) for r in rollouts],
        "reward": sum(rewards) / len(rewards),
        "exact": sum(is_exact(prompts[r.prompt_index], r.text) for r in rollouts) / len(rollouts),
        "mean_completion_tokens": num_tokens / len(rollouts),
        "rollout_s": seconds,
        "rollout_tok_s": num_tokens / seconds,
        "example": {"prompt": prompts[0].messages[0]["content"], "completion": rollouts[0].text},
    }


def train_step(policy: Policy, rollouts: list[Rollout], rewards: list[float], args: Any) -> dict:
    """One GRPO step; the mismatch is measured on every sampled token, before the update.

    Groups whose samples all scored alike have zero advantage: their tokens go through a forward
    without grad (for the mismatch only), which saves their backward pass.
    """
    adv = group_advantages(torch.tensor(rewards), args.samples_per_prompt)
    old = [torch.tensor(r.logprobs) for r in rollouts]
    new: list[torch.Tensor] = [torch.empty(0)] * len(rollouts)
    learn = [i for i in range(len(rollouts)) if adv[i] != 0]
    rest = [i for i in range(len(rollouts)) if adv[i] == 0]
    pad_id = rollouts[0].prompt_ids[-1]  # any id: padded positions are masked and never read

    def batch(idx: list[int]) -> Any:
        return make_batch([rollouts[i].prompt_ids for i in idx],
                          [rollouts[i].token_ids for i in idx], pad_id)  # fmt: skip

    stats: dict[str, float] = {"num_learning_samples": len(learn)}
    if rest:
        with torch.no_grad():
            for i, lp in zip(rest, policy.token_logprobs(batch(rest))):
                new[i] = lp
    if learn:
        logprobs = policy.token_logprobs(batch(learn))
        normalizer = len(rollouts) * args.max_new_tokens
        loss, loss_stats = grpo_loss(logprobs, [old[i] for i in learn], adv[learn], normalizer)
        loss.backward()
        stats |= loss_stats | {"loss": float(loss.detach()), "grad_norm": policy.step()}
        for i, lp in zip(learn, logprobs):
            new[i] = lp.detach()
    diffs = torch.cat([(n - o).abs() for n, o in zip(new, old)])
    return stats | {"mismatch": float(diffs.mean()), "mismatch_max": float(diffs.max())}


class Run:
    """The loop's state: the server connection, the policy, and what has been logged."""

    def __init__(self, args: argparse.Namespace, client: TrainerClient, policy: Policy) -> None:
        self.args = args
        self.client = client
        self.policy = policy
        self.model_name = ADAPTER if policy.is_lora else client.get("/v1/models")["data"][0]["id"]
        # The version that says which weights sampled: the adapter's, or the whole model's.
        self.version_key = "lora_version" if policy.is_lora else "weight_version"
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.rng = random.Random(args.seed)
        self.sync = WeightSync(client, args.weight_sync)
        self.version = client.weight_version()

    def greedy_probe(self) -> list[list[int]]:
        ids = [encode(self.tokenizer, p) for p in PROBE_PROMPTS]
        return greedy(self.client, self.model_name, ids, PROBE_TOKENS)

    def push(self, version: str, full: bool = False) -> dict[str, float]:
        """Pushes the policy (with LoRA the adapter alone, unless `full`: the base weights);
        returns its seconds and bytes."""
        start = time.perf_counter()
        if self.policy.is_lora and not full:
            num_bytes = nbytes(self.policy.adapter_weights())
            self.sync.push_lora(ADAPTER, self.policy.model, version)
        else:
            weights = self.policy.named_weights()
            num_bytes = nbytes(weights)
            self.sync.push(weights, version)
            assert self.client.weight_version() == version
        self.version = version
        return {"update_s": time.perf_counter() - start, "update_bytes": num_bytes}

    def step(self, step: int, is_last: bool) -> dict[str, Any]:
        args = self.args
        prompts = sample_prompts(self.rng, args.prompts_per_step)
        ids = [encode(self.tokenizer, p) for p in prompts]
        start = time.perf_counter()
        rollouts, versions = sample(self.client, self.model_name, ids, args.samples_per_prompt,
                                    args.max_new_tokens, args.seed * 100_003 + step)  # fmt: skip
        record: dict[str, Any] = {"step": step, **versions}
        record |= rollout_stats(prompts, rollouts, time.perf_counter() - start)
        # NOTE: on-policy: these tokens came from the weights the trainer holds right now.
        assert versions.get(self.version_key) == self.version, (versions, self.version)
        if not is_last:
            record |= self.train_and_push(step, rollouts, record["rewards"])
        record["load_avg"] = os.getloadavg()[0]
        return record

    def train_and_push(self, step: int, rollouts: list[Rollout], rewards: list[float]) -> dict:
        timings: dict[str, float] = {}
        if self.args.colocate:
            start = time.perf_counter()
            self.client.sleep(level=2)  # frees tern's weights and KV cache for the trainer
            timings["sleep_s"] = time.perf_counter() - start
        start = time.perf_counter()
        stats = train_step(self.policy, rollouts, rewards, self.args)
        timings["train_s"] = time.perf_counter() - start
        if self.args.colocate:
            start = time.perf_counter()
            self.client.wake_up(["weights"])  # empty weights: the push fills them
            timings["wake_s"] = time.perf_counter() - start
        timings |= self.push(f"step-{step + 1}")
        if self.args.colocate:
            start = time.perf_counter()
            self.client.wake_up(["kv_cache"])
            timings["wake_s"] += time.perf_counter() - start
        return stats | timings


def run(args: argparse.Namespace, base_url: str, policy: Policy, log: dict[str, Any]) -> None:
    client = TrainerClient(base_url)
    r = Run(args, client, policy)
    try:
        if args.base_url:  # a server we did not start may hold other weights than --model
            r.push("rl-init", full=True)
        log["weight_version_start"] = client.weight_version()
        log["full_weight_bytes"] = nbytes(policy.named_weights())
        if policy.is_lora:  # the initial adapter (B = 0: the base model's outputs)
            log["adapter_bytes"] = nbytes(policy.adapter_weights())
            log["initial_push"] = r.push("step-0")
        log["greedy_before"] = r.greedy_probe()
        for step in range(args.steps + 1):
            record = r.step(step, is_last=step == args.steps)
            print(format_step(record), flush=True)
            log["steps"].append(record)
            write_log(args.out_dir / "log.json", log)
        log["greedy_after"] = r.greedy_probe()
        log["weight_version_end"] = client.weight_version()
    finally:
        r.sync.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    # SIGTERM unwinds like Ctrl-C, so the finally below stops the server it launched.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                           "machine": machine_info(), "steps": []}  # fmt: skip
    wall_start = time.perf_counter()
    server = None
    try:
        if args.base_url is None:
            server = launch(args.model, args.dtype, args.seed, args.quantization, args.lora,
                            args.batch_invariant)  # fmt: skip
        # The policy loads while tern starts.
        policy = Policy(args.model, DTYPES[args.dtype], args.lr, args.lora, args.lora_alpha)
        if server is not None:
            server.wait_ready()
            log["server_pids"] = [server.proc.pid, *server.descendants]
        run(args, args.base_url or server.base_url, policy, log)
    finally:
        if server is not None:
            server.shut_down(30)
        log["wall_s"] = time.perf_counter() - wall_start
        with contextlib.suppress(OSError):
            write_log(args.out_dir / "log.json", log)
    summarize(args, log)
    return 0


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


def summarize(args: argparse.Namespace, log: dict[str, Any]) -> None:
    steps = log["steps"]
    first, last = steps[0], steps[-1]
    trained = [s["mismatch"] for s in steps if "mismatch" in s]
    mismatch = sum(trained) / len(trained) if trained else math.nan
    served = f" (tern {args.quantization})" if args.quantization else ""
    served += " (tern batch-invariant)" if args.batch_invariant else ""
    lora = f" LoRA r{args.lora}" if args.lora else ""
    title = (f"GRPO via tern, {Path(args.model).name}{lora} {args.dtype}{served}, "
             f"{args.prompts_per_step}x{args.samples_per_prompt} samples/step")  # fmt: skip
    push = push_summary(steps, log["full_weight_bytes"])
    plot(args.plot, steps, title, push)
    key = "lora_version" if args.lora else "weight_version"
    print(f"reward {first['reward']:.3f} -> {last['reward']:.3f} (exact {first['exact']:.2f} -> "
          f"{last['exact']:.2f}) in {args.steps} steps, {log['wall_s']:.0f} s wall; "
          f"mean mismatch {mismatch:.2e}; {push}; {key} {first[key]} -> {last[key]}; "
          f"log {args.out_dir / 'log.json'}, plot {args.plot}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
