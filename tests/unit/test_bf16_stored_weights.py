"""bfloat16-stored weights under float32 arithmetic: what `--dtype bfloat16` gives on a CPU without
bfloat16 arithmetic (AVX2-only; here the avx2 kernel tier stands in for one).

- The kernel (csrc/linear_f32.c: tern_bf16w_linear) equals float32 F.linear on the widened weight,
  on every tier this CPU runs, at row counts and widths that hit every remainder and tile edge.
- The engine: the model computes in float32 with its linear and embedding weights stored
  bfloat16, and its greedy tokens and logprobs equal Hugging Face's float32 model run on the same
  weights rounded to bfloat16 (a checkpoint written so).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from enginecore.config import CacheConfig, Config, ModelConfig
from tests.unit.test_model_runner import GREEDY, make_prompts, run
from workers.kernels import kernel_library, linear_ops
from workers.kernels.kernel_library import runnable_tiers, use_tier
from workers.layers.embedding import VocabParallelEmbedding
from workers.layers.linear import LinearBase, dense_linear
from workers.runner.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(kernel_library.load() is None, reason="no C compiler")

# A tier without bfloat16 arithmetic that every x86-64 CPU of this project runs.
BF16_STORED = ("proj.weight", "embed_tokens.weight", "lm_head.weight")
NO_BF16_TIER = "avx2" if "avx2" in {t.name for t in runnable_tiers()} else "baseline"


@pytest.mark.usefixtures("kernel_tier")
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 63])
@pytest.mark.parametrize("out_features,in_features", [(13, 20), (61, 33), (96, 64), (960, 576)])
def test_kernel_matches_float32_linear(rows: int, out_features: int, in_features: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g)
    expected = F.linear(x, w.float(), b)
    torch.testing.assert_close(linear_ops.bf16w_linear(x, w, b), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        linear_ops.bf16w_linear(x, w, None), expected - b, atol=1e-4, rtol=1e-4
    )
    # dense_linear routes float32 rows against a bfloat16 weight here, and many rows to BLAS
    torch.testing.assert_close(dense_linear(x, w, b), expected, atol=1e-4, rtol=1e-4)
    many = torch.randn(70, in_features, generator=g)
    torch.testing.assert_close(dense_linear(many, w, b), F.linear(many, w.float(), b))
    with pytest.raises(ValueError, match="does not fit"):
        linear_ops.bf16w_linear(x[:, 1:].contiguous(), w, b)
    with pytest.raises(ValueError, match="float32"):
        linear_ops.bf16w_linear(x.bfloat16(), w, b)


@pytest.fixture(scope="module")
def rounded_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_llama with its linear and embedding weights rounded to bfloat16 (stored float32; the
    norms and biases as they were): what the engine holds, for Hugging Face to run in float32."""
    out = tmp_path_factory.mktemp("rounded_llama")
    for f in tiny_llama.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            rounded = {
                k: v.bfloat16().float() if k.endswith(BF16_STORED) else v
                for k, v in tensors.items()
            }
            save_file(rounded, out / f.name)
        elif f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def test_engine_on_a_cpu_without_bf16_arithmetic(tiny_llama: Path, rounded_llama: Path) -> None:
    config = Config(
        model=ModelConfig(path=str(tiny_llama), dtype="bfloat16"),
        cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
    )
    with use_tier(NO_BF16_TIER):
        runner = ModelRunner(config)
        runner.load_model()
        runner.init_kv_cache(256)
        assert (runner.dtype, runner.weight_dtype) == (torch.float32, torch.bfloat16)
        assert "bfloat16-stored weights" in runner.model_summary
        weights = [
            m.weight
            for m in runner.model.modules()
            if isinstance(m, (LinearBase, VocabParallelEmbedding))
        ]
        assert weights and all(w.dtype == torch.bfloat16 for w in weights)
        assert all(
            m.packed_weight is None for m in runner.model.modules() if hasattr(m, "packed_weight")
        )
        assert runner.kv_cache.dtype == torch.float32
        prompts = make_prompts(512)
        reqs = run(runner, prompts, GREEDY, chunk_size=7)

    hf = transformers.AutoModelForCausalLM.from_pretrained(rounded_llama, dtype=torch.float32)
    hf.eval()
    with torch.no_grad():
        for r in reqs.values():
            ids = torch.tensor([r.prompt + r.output])
            logits = hf(ids).logits[0, len(r.prompt) - 1 : -1].float()
            assert r.output == logits.argmax(-1).tolist()  # greedy: each token HF's argmax
            ours = torch.stack(r.logprobs)
            torch.testing.assert_close(ours, logits.log_softmax(-1), atol=1e-3, rtol=0)
