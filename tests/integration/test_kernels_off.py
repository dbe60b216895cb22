"""TERN_KERNELS=off for a whole server: the workers inherit it, run the pure-torch paths, say so
in the start-up log, and their greedy tokens and logprobs still equal Hugging Face's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM


def test_kernels_off_for_a_whole_server(
    launch_server, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TERN_KERNELS", "off")
    server = launch_server("--model", str(tiny_llama), "--dtype", "float32")
    assert "kernels: off (TERN_KERNELS=off" in server.log
    assert "fused decode layer: off, reason: the kernels are off" in server.log
    assert "decode floor: " in server.log  # the weights per step over the measured bandwidth
    # The workers wait at OpenMP barriers briefly before they sleep (enginecore/executor.py).
    server.record_descendants()
    spawned = {pid: p for pid, p in server.descendants.items()
               if "spawn_main" in " ".join(p.cmdline())}  # fmt: skip
    workers = [p for p in spawned.values() if p.ppid() in spawned]  # the engine core's children
    assert workers and all(p.environ().get("GOMP_SPINCOUNT") == "1000" for p in workers)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for prompt in ([5, 17, 300, 41], list(range(7, 40))):
        body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True},
            "return_logprob": True,
        }
        r = httpx.post(f"{server.base_url}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        ids = prompt + out["output_ids"]
        with torch.no_grad():
            logprobs = hf(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        assert out["output_ids"] == logprobs.argmax(-1).tolist()
        ours = torch.tensor([e[0] for e in out["meta_info"]["output_token_logprobs"]])
        theirs = logprobs.gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
        torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=0)
