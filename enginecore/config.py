"""The one configuration object of a tern server, built by the CLI and passed down to every process.

Frozen dataclasses, validated in __post_init__. Environment variables are read once, here. Per-rank
copies are made with dataclasses.replace. The model's own shape (layers, heads) is not here: workers
read it from config.json; the engine core only needs the number of KV-cache blocks, which workers report.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path


def tern_home() -> Path:
    """Cache directory of converted models and compiled artefacts (TERN_HOME, default ~/.cache/tern)."""
    return Path(os.environ.get("TERN_HOME") or Path.home() / ".cache" / "tern")


# In a model directory prepared from a GGUF file (frontend/gguf_model.py): the file it serves.
GGUF_SOURCE_FILE = "gguf_source.json"


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
# What the served model does (--task; auto: from config.json, see enginecore/model_task.py) and how
# a pooling model pools a prompt's final hidden states (--pooling-type).
TASKS = ("auto", "generate", "embed", "classify", "reward")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(frozen=True)
class ModelConfig:
    path: str
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: min(model's max_position_embeddings, 32768)
    served_model_name: str = ""
    seed: int = 0
    # Weight-only quantization applied at load time: None | int8 (workers/quant/quantization.py)
    # | int4 (INT4_ZP blocks of 32 with a scale and zero point: workers/quant/int4_blocks.py)
    quantization: str | None = None
    # What sampled tokens' logprobs describe (vLLM's names): raw_logprobs, the model's distribution,
    # or processed_logprobs, the one the sampler drew from (workers/sample/logprobs.py).
    logprobs_mode: str = "raw_logprobs"
    task: str = "auto"
    # A pooling task's pooling of each prompt: its last token (LAST, as Hugging Face's sequence
    # classifiers), the mean over its tokens (MEAN) or its first token (CLS).
    pooling_type: str = "LAST"
    # Mixture-of-experts models: the engine keeps the experts each token was routed to in each
    # layer (routing replay for RL), returned to the requests that ask (enginecore/routing.py).
    enable_return_routed_experts: bool = False
    # Each request's logits independent of the rest of the batch, of prefill chunking and of the
    # prefix cache (float32, kernels with one arithmetic per row; workers/runner/model_runner.py).
    batch_invariant: bool = False
    # A checkpoint released with a vision or audio tower served as its language model alone
    # (vLLM's --language-model-only): the towers are neither built nor loaded, media are refused.
    language_model_only: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"--task must be one of {', '.join(TASKS)}, not {self.task!r}")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(
                f"--pooling-type must be one of {', '.join(POOLING_TYPES)}, "
                f"not {self.pooling_type!r}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"--logprobs-mode must be one of {', '.join(LOGPROBS_MODES)}, "
                f"not {self.logprobs_mode!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"--dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}"
            )
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"--quantization must be int8 or int4, not {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("--max-model-len must be positive")
        if self.batch_invariant and self.dtype not in ("auto", "float32"):
            raise ValueError("--batch-invariant computes in float32: give --dtype float32")
        if self.batch_invariant and self.quantization is not None:
            raise ValueError("--batch-invariant serves unquantized float32 weights only")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory_gib: float = 1.0
    enable_prefix_caching: bool = True
    # Overrides the count derived from kv_cache_memory_gib (tests use it to force preemption).
    num_gpu_blocks_override: int | None = None
    # Hybrid models: tokens between linear-attention state checkpoints (None: the workers choose).
    state_checkpoint_interval: int | None = None
    # "auto": the activations' dtype; "int8": each token's K and V rows per head int8 with a
    # float32 scale per 16 values (workers/quant/kv_int8.py).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("--block-size must be a power of two")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(
                f"--kv-cache-dtype must be auto or int8, not {self.kv_cache_dtype!r} (fp8 has no "
                "fast path on these CPUs)"
            )
        interval = self.state_checkpoint_interval
        if interval is not None and (interval < 1 or interval % self.block_size):
            raise ValueError(
                f"--state-checkpoint-interval must be a positive multiple of --block-size "
                f"({self.block_size}), not {interval}"
            )
        if self.kv_cache_memory_gib <= 0:
            raise ValueError("--kv-cache-memory must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be positive")
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be positive")


# Placement-group strategies of Ray (--ray-placement-strategy).
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks are laid out TP-major: rank = pp_rank * tensor_parallel_size + tp_rank.

    Node n runs ranks [n * world_size / nnodes, (n + 1) * world_size / nnodes); node 0 also runs
    the engine core.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_backend: str | None = None  # None: nccl on GPU, gloo on CPU
    # Every collective (and the rendezvous) fails after this long instead of hanging forever.
    distributed_timeout_s: float = float(os.environ.get("TERN_DIST_TIMEOUT", "60"))
    # host:port of torch.distributed's TCP store. None on one node: the executor picks a free port
    # on 127.0.0.1 and fills it in; with several nodes it must be given (node 0's address).
    dist_init_addr: str | None = None
    # CPU TP groups on one host all-reduce through shared memory (workers/shm_collectives.py)
    # rather than gloo; TERN_SHM_COLLECTIVES=0 keeps gloo (to compare).
    shm_collectives: bool = os.environ.get("TERN_SHM_COLLECTIVES", "1") != "0"
    nnodes: int = 1
    node_rank: int = 0
    # Mixture-of-experts models: each TP rank holds whole experts (workers/layers/moe.py).
    enable_expert_parallel: bool = False
    # --dp: replicas, each an engine core with its own tp x pp workers (frontend/engine/client.py);
    # data_parallel_rank is the replica these settings are for (set per replica by the frontend).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # --distributed-executor-backend: "mp" spawns the ranks as child processes of the engine core;
    # "ray" places each rank as a Ray actor in a placement group (enginecore/ray_executor.py).
    distributed_executor_backend: str = "mp"
    ray_placement_strategy: str = "PACK"  # of the placement group the ray backend makes
    ray_address: str | None = None  # None: $RAY_ADDRESS, a running local cluster, or a new one
    # A placement group that exists already (a Ray Serve replica's, frontend/ray_serve/): its hex
    # id, and the bundle each rank goes in (default 0..world_size-1). Not a flag.
    ray_placement_group: str | None = None
    ray_bundle_indices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self._check_executor_backend()
        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be >= 1")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"replica {self.data_parallel_rank} outside --dp {self.data_parallel_size}"
            )
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError("--dp > 1 runs on one node: use a router across hosts instead")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("--tensor-parallel-size and --pipeline-parallel-size must be >= 1")
        if self.distributed_backend not in (None, "gloo", "nccl"):
            raise ValueError(
                f"--distributed-backend must be gloo or nccl, not {self.distributed_backend!r}"
            )
        if self.distributed_timeout_s <= 0:
            raise ValueError("the distributed timeout must be positive")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.world_size % self.nnodes:
            raise ValueError(
                f"tp x pp = {self.world_size} workers do not split evenly over {self.nnodes} nodes"
            )
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--nnodes > 1 needs --dist-init-addr host:port (node 0's address)")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--dist-init-addr must be host:port, not {self.dist_init_addr!r}")

    def _check_executor_backend(self) -> None:
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(
                "--distributed-executor-backend must be mp or ray, not "
                f"{self.distributed_executor_backend!r}"
            )
        if self.ray_placement_strategy not in RAY_PLACEMENT_STRATEGIES:
            raise ValueError(
                f"--ray-placement-strategy must be one of {', '.join(RAY_PLACEMENT_STRATEGIES)}"
            )
        if self.distributed_executor_backend == "mp":
            given = [
                flag
                for flag, value in (
                    ("--ray-address", self.ray_address),
                    ("--ray-placement-strategy", self.ray_placement_strategy != "PACK" or None),
                    ("a Ray placement group", self.ray_placement_group),
                )
                if value
            ]
            if given:
                need = "need" if len(given) > 1 else "needs"
                raise ValueError(f"{', '.join(given)} {need} --distributed-executor-backend ray")
        elif self.ray_bundle_indices is not None and (
            len(self.ray_bundle_indices) != self.world_size or self.ray_placement_group is None
        ):
            raise ValueError(
                f"a placement group's bundle indices must name one bundle per rank "
                f"({self.world_size}), of a given placement group"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(
            self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node
        )

    @property
    def first_device_index(self) -> int:
        """Replica d's rank r uses device first_device_index + r (GPUs: d * tp * pp + r)."""
        return self.data_parallel_rank * self.world_size

    @property
    def num_local_workers(self) -> int:
        """Worker processes on this node over every replica: they share its cores and memory."""
        return self.ranks_per_node * self.data_parallel_size

    @property
    def driver_rank(self) -> int:
        """The rank that samples and answers each step: TP rank 0 of the last pipeline stage."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


@dataclass(frozen=True)
class StructuredOutputConfig:
    # JSON number literals of at most 17 significant digits and 3 exponent digits
    # (enginecore/json_grammar.py); --no-json-number-bound lifts it.
    bound_json_numbers: bool = True


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (--enable-lora; enginecore/lora.py). Off: no layer carries adapter slots."""

    enabled: bool = False
    max_loras: int = 4  # distinct adapters in one step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded on the workers (LRU beyond); max_loras
    modules: tuple[tuple[str, str], ...] = ()  # (name, path) served from start-up

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        if self.max_lora_rank > 256:
            raise ValueError("--max-lora-rank is at most 256")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError("--max-cpu-loras must be at least --max-loras")
        if self.modules and not self.enabled:
            raise ValueError("LoRA modules need --enable-lora")

    @property
    def num_slots(self) -> int:
        """Adapters the workers hold at once."""
        return self.max_cpu_loras or self.max_loras


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "mtp", "eagle3")
# The methods whose drafts the workers make with a model (workers/spec/draft_model.py, head_drafter.py).
MODEL_DRAFT_METHODS = ("draft_model", "mtp", "eagle3")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (--speculative-config, vLLM's keys; enginecore/speculative.py).
    Off when `method` is None."""

    # ngram | suffix | draft_model | mtp (the checkpoint's own head) | eagle3 (a head's checkpoint)
    method: str | None = None
    num_speculative_tokens: int = 0  # the most drafts a sequence verifies in one step
    model: str | None = None  # draft_model / eagle3: the draft's directory (the same vocabulary)
    prompt_lookup_min: int = 2  # ngram: the shortest suffix matched
    prompt_lookup_max: int = 5  # ngram: the longest suffix matched
    # No drafts in a step that runs more sequences than this (None: SPEC_MAX_BATCH_DEFAULT).
    disable_by_batch_size: int | None = None
    suffix_decoding_max_tree_depth: int = 24  # suffix: the longest pattern + continuation
    suffix_decoding_max_cached_requests: int = 256  # suffix: finished requests' outputs kept
    suffix_decoding_max_spec_factor: float = 1.0  # suffix: drafts <= factor x match length
    suffix_decoding_min_token_prob: float = 0.1  # suffix: stop drafting below this estimate

    def __post_init__(self) -> None:
        if self.method is None:
            return
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method {self.method!r} is not served; tern has "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        if (self.method in ("draft_model", "eagle3")) != (self.model is not None):
            raise ValueError(
                'a draft model or head ("model") goes with methods draft_model and eagle3, and only'
            )
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in [1, 64]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")
        if self.suffix_decoding_max_tree_depth < 2 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix decoding needs a tree depth >= 2 and a cache size >= 0")
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError("suffix_decoding_max_spec_factor must be positive")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.method is not None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000


# Prefill/decode disaggregation (--kv-transfer-config, vLLM's keys; SGLang's --disaggregation-*).
KV_CONNECTORS = ("TernConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


@dataclass(frozen=True)
class KVTransferConfig:
    """A producer computes prompts and lends their KV blocks for `lease_s` (vLLM's
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT); a consumer pulls them and decodes (docs/disaggregation.md).
    Off when `connector` is None."""

    connector: str | None = None
    role: str = "kv_both"
    # A consumer whose pull fails: "fail" ends the request with an error (vLLM's default),
    # "recompute" computes the prompt itself.
    load_failure_policy: str = "fail"
    # Where consumers reach this server's bootstrap (its lease registry): SGLang's
    # --disaggregation-bootstrap-port, vLLM's remote_host / remote_port.
    bootstrap_host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    lease_s: float = 480.0
    # A consumer waits this long for a producer's lease to appear (SGLang's one-shot dispatch
    # reaches both at once), and this long for any answer of a producer (then deems it gone).
    wait_s: float = 300.0
    reply_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.connector is None:
            return
        if self.connector not in KV_CONNECTORS:
            raise ValueError(
                f"kv_connector {self.connector!r} is not served; tern has {', '.join(KV_CONNECTORS)}"
            )
        if self.role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}")
        if self.load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {', '.join(KV_LOAD_FAILURE_POLICIES)}"
            )
        if not 0 < self.bootstrap_port < 65536:
            raise ValueError("the bootstrap port must be in [1, 65535]")
        if min(self.lease_s, self.wait_s, self.reply_timeout_s) <= 0:
            raise ValueError("kv lease and wait times must be positive")

    @property
    def enabled(self) -> bool:
        return self.connector is not None

    @property
    def produces(self) -> bool:
        return self.enabled and self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.enabled and self.role in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    structured_output: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    # Directory of this instance's IPC sockets: unique per server so that instances never collide.
    # Made by the first socket bound in it (ipc_path), not here: most Configs never bind one.
    ipc_dir: str = field(
        default_factory=lambda: os.path.join(tempfile.gettempdir(), f"tern-{uuid.uuid4().hex}")
    )
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    # Seconds a child process has to acknowledge it is ready (model loading included).
    startup_timeout_s: float = float(os.environ.get("TERN_STARTUP_TIMEOUT", "300"))
    # Seconds without any message from the engine core (it sends a heartbeat every second, even
    # inside a long step) after which the frontend deems it hung, kills it and answers 503.
    engine_heartbeat_timeout_s: float = float(os.environ.get("TERN_ENGINE_HEARTBEAT_TIMEOUT", "20"))

    def ipc_path(self, name: str) -> str:
        """The ZMQ address of socket `name` in ipc_dir (created, private, if it is not there)."""
        os.makedirs(self.ipc_dir, mode=0o700, exist_ok=True)
        return f"ipc://{self.ipc_dir}/{name}"

    def replace(self, **changes: object) -> Config:
        return dataclasses.replace(self, **changes)
