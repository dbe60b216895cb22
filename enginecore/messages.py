"""Every message that crosses a process boundary in tern, as msgspec structs (msgpack on the wire).

Four links:
- frontend <-> engine core (ZMQ): a one-byte `RequestType` frame followed by the encoded body going
  in; `EngineCoreOutputs` coming back.
- engine core -> workers (shared-memory broadcast, ZMQ fallback for large messages): `WorkerCall`.
- workers -> engine core (ZMQ): `WorkerReply`.
- other nodes' worker launchers <-> engine core (ZMQ over TCP, --nnodes > 1): `NodeToCore`,
  `CoreToNode`.

The engine core and the workers speak token ids only: text, chat templates and stop strings live in
the frontend. No pickle on any link.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from enginecore.shm_broadcast import Handle


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, or (decided by the frontend) a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # the client went away or asked to abort
    ERROR = "error"  # the engine failed while serving the request


class TimestampRule(msgspec.Struct, array_like=True):
    """Whisper's timestamp tokens, as Hugging Face's WhisperTimeStampLogitsProcessor samples them:
    never <|notimestamps|>; timestamps in pairs (except before EOS), never decreasing; the first
    output token a timestamp no later than `max_initial_index`; and a timestamp whenever the
    timestamps' summed probability beats every text token's."""

    timestamp_begin: int  # <|0.00|>, the first timestamp token; every later id is one
    eos_token_id: int  # tokens below it are text
    no_timestamps_token_id: int
    max_initial_index: int | None = None


class CrossAttentionRows(msgspec.Struct, array_like=True):
    """Whisper's word timestamps: the decoder's cross-attention probabilities over the audio's
    encoder frames at these (layer, head) pairs (generation_config.json's alignment_heads), for
    every output token the model reads (frontend/audio/alignment.py aligns them to the audio)."""

    heads: list[tuple[int, int]]

    @property
    def row_floats(self) -> int:
        """float32s per position: per head, one per encoder frame (a 30 s window's 1500)."""
        return len(self.heads) * CROSS_ATTENTION_FRAMES


# A Whisper window's encoder frames (20 ms each): what a cross-attention row spans.
CROSS_ATTENTION_FRAMES = 1500


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """What the engine core and the workers need to know to sample one request's tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    min_p: float = 0.0
    # Seeds make sampling reproducible: the noise of output token i depends only on (seed, i), never
    # on the batch a request shares. Requests without a seed get a random one in the engine core.
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    eos_token_ids: list[int] = []  # from generation_config.json, filled in by the frontend
    ignore_eos: bool = False
    # Logits processing on the worker, before sampling (workers/sample/logits_processors.py): only
    # these tokens may be sampled (empty: all); bias added to the logits; suppressed tokens
    # (always, or at the first output token); before min_tokens, EOS
    # and stop_token_ids are forbidden; Hugging Face's repetition penalty over prompt and output;
    # OpenAI's frequency and presence penalties over the output.
    allowed_token_ids: list[int] = []
    logit_bias: dict[int, float] = {}
    # Tokens never sampled, and tokens not sampled first (Hugging Face's SuppressTokens and
    # SuppressTokensAtBegin logits processors: Whisper's generation_config.json lists them).
    suppress_token_ids: list[int] = []
    begin_suppress_token_ids: list[int] = []
    timestamps: TimestampRule | None = None  # Whisper's timestamp decoding
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Logprobs of the sampled tokens / of the prompt's tokens, each with this many most likely
    # tokens besides; None: not computed. Taken from the raw logits (before everything above),
    # except with --logprobs-mode processed_logprobs: then the sampled tokens' are after it all.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Not sampling, but what the workers return beside each output token (word timestamps).
    cross_attention: CrossAttentionRows | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def needs_history(self) -> bool:
        """The worker must know every token of the request, also those from the prefix cache."""
        return self.has_penalties or self.prompt_logprobs is not None or self.timestamps is not None


class Logprobs(msgspec.Struct, array_like=True, omit_defaults=True):
    """log_softmax of the raw logits (or of the processed ones: --logprobs-mode) at consecutive
    positions of one request.

    Position i: the logprob and rank (1 = most likely; ties count against it) of its token (the
    sampled one, or the prompt's next token), and the `num_top` most likely tokens, best first,
    flat: top_token_ids[i * num_top : (i + 1) * num_top].
    """

    token_ids: list[int] = []
    logprobs: list[float] = []
    ranks: list[int] = []
    num_top: int = 0
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []

    @property
    def num_positions(self) -> int:
        return len(self.token_ids)

    def top(self, i: int) -> list[tuple[int, float]]:
        """Position i's most likely tokens, best first: (token id, logprob)."""
        lo, hi = i * self.num_top, (i + 1) * self.num_top
        return list(zip(self.top_token_ids[lo:hi], self.top_logprobs[lo:hi]))

    def slice(self, start: int, stop: int) -> Logprobs:
        k = self.num_top
        return Logprobs(
            self.token_ids[start:stop],
            self.logprobs[start:stop],
            self.ranks[start:stop],
            k,
            self.top_token_ids[start * k : stop * k],
            self.top_logprobs[start * k : stop * k],
        )

    @staticmethod
    def concat(parts: list[Logprobs]) -> Logprobs:
        parts = [p for p in parts if p.num_positions]
        if not parts:
            return Logprobs()
        k = parts[0].num_top
        assert all(p.num_top == k for p in parts), "positions of one request share num_top"
        return Logprobs(
            [t for p in parts for t in p.token_ids],
            [v for p in parts for v in p.logprobs],
            [r for p in parts for r in p.ranks],
            k,
            [t for p in parts for t in p.top_token_ids],
            [v for p in parts for v in p.top_logprobs],
        )


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens start, start + 1, ... (token 0 has none: nothing precedes it)."""

    start: int
    logprobs: Logprobs


# --------------------------------------------------------------------------- frontend <-> core


class RequestType(bytes, enum.Enum):
    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    RELEASE_KV = b"\x03"  # KVLeaseRelease: a consumer took (or gave up) a producer's blocks
    KV_PULLED = b"\x04"  # KVPulled: the engine core's own puller thread finished a pull


class StructuredOutputKind(str, enum.Enum):
    JSON = "json"  # spec: a JSON schema (JSON text)
    JSON_OBJECT = "json_object"  # any JSON object; spec unused
    REGEX = "regex"
    GRAMMAR = "grammar"  # EBNF (GBNF): `root ::= ...`
    STRUCTURAL_TAG = "structural_tag"  # spec: xgrammar's structural tag (JSON text)


class StructuredOutputSpec(msgspec.Struct, omit_defaults=True):
    """A constraint on a request's output, compiled by the engine core (xgrammar).

    The frontend has validated it (a bad one is the client's 400); the engine core compiles it off
    its step loop and masks each sampled token by it.
    """

    kind: StructuredOutputKind
    spec: str = ""
    # JSON schemas: allow any whitespace between tokens (else the compact form xgrammar prefers).
    any_whitespace: bool = True
    # The output's reasoning ends with these tokens: the constraint applies from the token after
    # them. Empty: from the first output token.
    reasoning_end_token_ids: list[int] = []


class TensorData(msgspec.Struct, array_like=True):
    """A tensor by value: dtype name (torch's, e.g. "float32"), shape and raw bytes (row-major)."""

    dtype: str
    shape: list[int]
    data: bytes


class MultiModalItem(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image of a prompt, as the frontend's processor made it (frontend/media/processing.py).

    `spans` are the runs of placeholder tokens its encoder output fills, as (first position, tokens),
    in prompt order: the encoder's rows fill them one after the other (Gemma 3's pan & scan crops
    are several runs). `content_hash` names the processed tensors: the prefix cache keys the blocks
    its placeholders fill by it, and the workers' encoder cache keeps its output under it.
    `tensors` are the processor's outputs for this item (pixel_values, ...); the engine core drops
    them once the workers hold the item, and sends them again after a preemption."""

    modality: str
    content_hash: str
    spans: list[tuple[int, int]]
    tensors: dict[str, TensorData] = {}

    @property
    def end(self) -> int:
        """The position after its last placeholder."""
        start, length = self.spans[-1]
        return start + length


class KVTransfer(msgspec.Struct, omit_defaults=True):
    """A request's part in prefill/decode disaggregation (enginecore/kv_transfer/).

    "produce": compute the prompt, then lend its full blocks under `lease_id` (until a consumer
    releases them or the lease ends). "consume": pull the blocks lent under `lease_id` by the
    producer whose bootstrap answers at `bootstrap_addr`, then compute the rest and decode."""

    role: str  # "produce" | "consume"
    lease_id: str
    bootstrap_addr: str = ""  # consume: tcp://host:port of the producer's lease registry
    # consume: the blocks the producer named (vLLM's remote_block_ids), checked against its lease
    remote_block_ids: list[int] | None = None


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    lora_name: str | None = None  # the LoRA adapter it runs on (enginecore/lora.py), None: base
    structured_output: StructuredOutputSpec | None = None
    # A pooling request (embedding, classification, reward; the served model's task): prefill only,
    # nothing sampled (sampling_params unused). Its one output carries `pooled` and finishes (STOP)
    # once every prompt token is computed; its KV blocks are freed then.
    pooling: bool = False
    # The prompt's images, in prompt order (models whose images tern serves, enginecore/model_task.py).
    mm_items: list[MultiModalItem] = []
    kv_transfer: KVTransfer | None = None


class EngineCoreAbort(msgspec.Struct):
    request_ids: list[str]


class KVLeaseRelease(msgspec.Struct):
    """Frontend -> a producer's engine core: these leases' blocks go back to the pool."""

    lease_ids: list[str]


class KVPulled(msgspec.Struct, omit_defaults=True):
    """The consumer's puller thread -> its engine core loop: a request's blocks arrived (one
    file per worker rank: `num_blocks` blocks of each KV-cache group, group after group) or
    could not be pulled (`error`)."""

    request_id: str
    paths: list[str] = []
    num_blocks: int = 0
    num_bytes: int = 0
    error: str | None = None
    # Hybrid models: each rank's linear-attention states after the blocks (one file a rank).
    state_paths: list[str] = []
    # --enable-return-routed-experts: the routing rows of the pulled positions.
    routing: bytes = b""
    # Both servers run the same draft model: each file holds its blocks after the served model's.
    with_draft: bool = False


class UtilityCall(msgspec.Struct):
    call_id: int
    op: EngineControlOp


class UtilityResult(msgspec.Struct, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


class RoutedExperts(msgspec.Struct, array_like=True):
    """Routing rows of consecutive positions of a request: int16 (positions, num_layers, top_k)
    in native byte order (enginecore/routing.py)."""

    data: bytes
    num_layers: int
    top_k: int
    num_experts: int


class RoutingShape(msgspec.Struct, array_like=True):
    """The model's MoE layers, experts per token and experts per layer (WorkerReady)."""

    num_layers: int
    top_k: int
    num_experts: int

    @property
    def row_bytes(self) -> int:
        return self.num_layers * self.top_k * 2


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    # Set on a request's first output only (wall-clock time.time() of the engine core): when the
    # request entered the waiting queue and when it was first scheduled (queue time = difference).
    queued_time: float | None = None
    first_scheduled_time: float | None = None
    # On a request's last output: the weight version its final tokens were computed with.
    weight_version: str | None = None
    # When the request asked for them: the logprobs of new_token_ids, and on its first output the
    # logprobs of its prompt tokens 1..n-1.
    new_logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    # A pooling request's result: the pooled hidden state (task "embed", not normalized: the
    # frontend truncates to `dimensions` and normalizes) or the score head's logits ("classify",
    # "reward"; no softmax).
    pooled: list[float] | None = None
    # --enable-return-routed-experts: the routing of the positions computed since the last output.
    routed_experts: RoutedExperts | None = None
    # On the last output of a request on a LoRA adapter: the adapter's version it ran on.
    lora_version: str | None = None
    # SamplingParams.cross_attention: float32 (positions, heads, frames) rows of the output
    # positions read since the last output (the last output token, never read, has none).
    cross_attention: bytes = b""
    # On the last output of a producing request (KVTransfer "produce"): its prompt's full blocks,
    # lent under its lease; empty when nothing is lent (it failed, or its prompt fills no block).
    kv_lease_block_ids: list[int] | None = None
    # With them, the blocks of the model's further KV-cache groups (sliding windows), by group.
    kv_lease_other_block_ids: list[list[int]] = []
    # With them, under --enable-return-routed-experts: the routing rows of the lent positions.
    kv_lease_routing: bytes = b""
    # With them, on a hybrid model: the state checkpoint holding its linear-attention states
    # after the prompt's last full block before its last token (-1: none kept).
    kv_lease_state_checkpoint: int = -1


class SchedulerStats(msgspec.Struct):
    num_running_reqs: int
    num_waiting_reqs: int
    num_preempted_total: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found cached
    num_prefill_tokens_total: int = 0  # tokens computed in prefill chunks (recomputation included)
    num_generated_tokens_total: int = 0  # tokens sampled
    # Hybrid models: per-sequence linear-attention states in the pool, and those free.
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    # Hybrid models with prefix caching: state checkpoints kept, and those holding one.
    num_state_checkpoints: int = 0
    num_used_state_checkpoints: int = 0
    # Mixture-of-experts models: tokens routed to each expert of each MoE layer since start-up,
    # flat (layers x experts, layer-major), and the experts per layer.
    expert_tokens_total: list[int] = []
    num_experts: int = 0
    # --enable-lora: --max-loras, and the adapters the running and the waiting requests are on.
    max_lora: int = 0
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # Speculative decoding (enginecore/speculative.py), totals: sequence-steps that verified
    # drafts, drafts verified, drafts accepted, and accepted at each draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Prefill/decode disaggregation, totals (vLLM's external prefix cache: prompt tokens a
    # consumer looked up at a producer, and those it pulled), pulls done and failed, and
    # bytes pulled; on a producer, leases lent and those still held.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_pulls_total: int = 0
    kv_pull_failures_total: int = 0
    kv_pull_bytes_total: int = 0
    kv_leases_total: int = 0
    num_kv_leases: int = 0


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    utility_results: list[UtilityResult] = []
    timestamp: float = 0.0
    # Set when the engine core can no longer serve: the frontend fails everything and reports unhealthy.
    engine_dead: str | None = None
    # Attached at most every STATS_INTERVAL_S while busy, and to the message that leaves it idle.
    scheduler_stats: SchedulerStats | None = None


class EngineReady(msgspec.Struct, tag="ready"):
    """The engine core's first message to the frontend once its workers are up."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    model_summary: str
    # What the served model does: "generate", or a pooling task ("embed", "classify", "reward"),
    # with the pooling type (LAST, MEAN, CLS), the pooled vector's size (hidden size for "embed",
    # num_labels otherwise) and the classifier's labels.
    task: str = "generate"
    pooling_type: str = "LAST"
    pooled_size: int = 0
    id2label: dict[int, str] = {}
    # --kv-transfer-config: every rank's KV endpoint and block layout, by rank.
    kv_endpoints: list[str] = []
    kv_layouts: list[KVLayout] = []


class EngineStartupFailed(msgspec.Struct, tag="failed"):
    """The engine core's first message when it could not start (the process then exits non-zero)."""

    error: str


EngineStartup = EngineReady | EngineStartupFailed


# --------------------------------------------------------------------------- core -> workers


class KVLoad(msgspec.Struct, array_like=True):
    """Blocks pulled from a producer, written into this step's request's tables before the
    forward pass: rank r reads `paths[r]` (its own share, every layer of its stage: the blocks of
    each KV-cache group in turn) and copies its block `src[i]` into the cache's block `dst[i]`
    (those the prefix cache had are skipped); then deletes the file."""

    paths: list[str]
    src: list[int]
    dst: list[int]
    # Hybrid models: rank r also reads `state_paths[r]`, the linear-attention states after the
    # pulled blocks, into the request's state row (then deletes it).
    state_paths: list[str] = []
    # A draft model's KV came too (KVLayout.draft): the file holds its blocks after the served
    # model's, and the first num_draft_blocks src/dst pairs (the first KV-cache group's, whose
    # block tables the draft model reads) go into its cache.
    num_draft_blocks: int = 0


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's share of a step. The worker keeps each request's block table between steps."""

    req_id: str
    token_ids: list[int]  # the tokens computed this step (a prefill chunk, or one decode token)
    start_pos: int  # position of token_ids[0] == tokens of this request already in the KV cache
    new_block_ids: list[int]  # appended to the request's block table (of KV-cache group 0)
    # Index of the output token sampled at the end of this step; -1 when a prefill chunk ends before
    # the prompt does (nothing sampled).
    sample_index: int
    # Present the first time a request is scheduled and when it resumes after preemption: the worker
    # then starts a new block table from new_block_ids.
    sampling_params: SamplingParams | None = None
    # With sampling_params, when sampling reads the request's tokens (SamplingParams.needs_history):
    # all of them so far (prompt, then outputs), also those served from the prefix cache that the
    # worker never computes, and how many of them are the prompt.
    history_token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    # Models whose attention layers form several KV-cache groups (workers/models/kv_cache_groups.py): the
    # blocks appended to each further group's table.
    other_group_block_ids: list[list[int]] = []
    # With sampling_params, on hybrid models: the request's row in the linear-attention state pools.
    state_slot: int = -1
    # With sampling_params: the worker slot of the LoRA adapter it runs on, -1: the base model.
    lora_slot: int = -1
    # Hybrid models with prefix caching (enginecore/state_checkpoints.py): the checkpoint whose
    # states the request starts from (with state_slot, on a prefix-cache hit), and [tokens into
    # this step's chunk, checkpoint] where its states after that many tokens are to be kept.
    restore_checkpoint: int = -1
    save_checkpoints: list[list[int]] = []
    # Speculative decoding: the last num_draft_tokens of token_ids are drafts. The request samples
    # at each of its last num_draft_tokens + 1 positions (output tokens sample_index, +1, ...) and
    # keeps the drafts up to the first that differs from the token sampled before it.
    num_draft_tokens: int = 0
    # Speculative decoding with a draft model: the workers draft this many tokens after token_ids
    # with it (workers/spec/draft_model.py), then verify them as above.
    num_model_drafts: int = 0
    # With sampling_params: the request's images whose placeholders are still to be computed (with
    # their tensors); the worker keeps them until the request finishes or is preempted.
    mm_items: list[MultiModalItem] = []
    # With sampling_params, on a consumer (prefill/decode disaggregation): its prompt's blocks
    # computed by a producer, loaded before this step's forward pass.
    kv_load: KVLoad | None = None


class SchedulerOutput(msgspec.Struct, omit_defaults=True):
    step_id: int
    requests: list[ScheduledRequest] = []
    finished_req_ids: list[str] = []  # the worker forgets these (finished, aborted or preempted)
    # Some requests sample under a grammar: their bitmasks follow as the next broadcast
    # (GrammarBitmasks), computed by the engine core while the workers run the forward pass.
    grammar_bitmasks_follow: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


class ExecuteModel(msgspec.Struct, tag="execute"):
    step: SchedulerOutput


class GrammarBitmasks(msgspec.Struct, tag="grammar_bitmasks"):
    """The tokens each constrained request may sample this step, as xgrammar packs them: one bit
    per vocabulary id in little-endian int32 words (ceil(vocab / 32) of them), by request id.
    Read by the sampling rank just before it samples; the other ranks skip it. A request with
    drafts has one bitmask per position it samples at, concatenated: the grammar's state after
    each draft (the engine core sends only drafts the grammar accepts)."""

    step_id: int
    bitmasks: dict[str, bytes]


# Computes a step's GrammarBitmasks.bitmasks: called while the workers run its forward pass.
BitmaskSource = Callable[[], dict[str, bytes]]


class InitKVCache(msgspec.Struct, tag="init_kv_cache"):
    num_blocks: int
    num_state_checkpoints: int = 0  # hybrid models' prefix-cache state checkpoints


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class UpdateWeightsFromDisk(msgspec.Struct, tag="update_from_disk"):
    model_path: str


class UpdateWeightsFromTensors(msgspec.Struct, tag="update_from_tensors"):
    """Named tensors as safetensors blobs (portable), or paths of safetensors files in /dev/shm that
    the trainer wrote on this host (zero-copy: the worker maps them)."""

    blobs: list[bytes] = []
    shm_paths: list[str] = []


class InitWeightsUpdateGroup(msgspec.Struct, tag="init_update_group"):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str | None = None
    timeout_s: float = 600.0


class UpdateWeightsFromDistributed(msgspec.Struct, tag="update_from_distributed"):
    group_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    # SGLang's "flattened_bucket": the trainer broadcasts the tensors as one flat tensor (their
    # concatenation, in the common dtype torch.cat gives them) instead of one broadcast each.
    flattened: bool = False


class DestroyWeightsUpdateGroup(msgspec.Struct, tag="destroy_update_group"):
    group_name: str


class CommitWeights(msgspec.Struct, tag="commit_weights"):
    """Ends a weight update on a worker: commit keeps the new weights, otherwise the old ones
    come back."""

    commit: bool


class LoraBroadcast(msgspec.Struct):
    """An adapter's tensors as the trainer broadcasts them over a weight-update group."""

    group_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    flattened: bool = False  # one broadcast of them all (SGLang's "flattened_bucket")


class LoadLora(msgspec.Struct, tag="load_lora"):
    """A PEFT adapter into a LoRA slot of every layer (workers/lora_adapters.py), scaled by
    `scaling`: its tensors from `path` (a PEFT directory), `blobs` (safetensors of the full
    tensors: one for every rank, or one per TP rank as SGLang sends them) or a trainer's
    `broadcast`, each rank keeping its shard."""

    slot: int
    rank: int
    scaling: float
    path: str = ""
    blobs: list[bytes] = []
    broadcast: LoraBroadcast | None = None


class Sleep(msgspec.Struct, tag="sleep"):
    """Free what `tags` name ("kv_cache", "weights"). The KV cache is discarded at either level;
    the weights at level 1 keep their values (moved to host memory on a GPU, left where they are
    on the CPU) and come back as they were, at level 2 are discarded (a weight update refills
    them)."""

    level: int
    tags: list[str]


class WakeUp(msgspec.Struct, tag="wake_up"):
    tags: list[str]  # "weights", "kv_cache"


ControlCall = (
    UpdateWeightsFromDisk
    | UpdateWeightsFromTensors
    | InitWeightsUpdateGroup
    | UpdateWeightsFromDistributed
    | DestroyWeightsUpdateGroup
    | CommitWeights
    | LoadLora
    | Sleep
    | WakeUp
)
CONTROL_CALLS = typing.get_args(ControlCall)  # for isinstance

# A new control call only joins ControlCall: the workers' union and dispatch follow from it.
WorkerCall = typing.Union[(ExecuteModel, GrammarBitmasks, InitKVCache, Shutdown, *CONTROL_CALLS)]  # noqa: UP007


# --------------------------------------------------------------------------- control (frontend -> core)
# Each control route's body becomes one of these at the frontend (frontend/control/routes.py), is
# checked there once, and travels as that type to the engine core (enginecore/control.py answers it)
# and, where workers act, inside it to the workers (the ControlCall it carries).


class GetStats(msgspec.Struct, tag="get_stats"):
    pass


class GetControlState(msgspec.Struct, tag="get_control_state"):
    pass


class PauseGeneration(msgspec.Struct, tag="pause"):
    # abort | wait | keep (= SGLang's in_place) | retract (also frees the running requests' cache)
    mode: str = "abort"


class ResumeGeneration(msgspec.Struct, tag="resume"):
    pass


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache"):
    pass


class UpdateOptions(msgspec.Struct, omit_defaults=True):
    """How a weight update ends: finished=False loads and holds the new weights (generation waits)
    until a later bucket or FinishWeightsUpdate commits them."""

    finished: bool = True
    flush_cache: bool = True  # False keeps prefixes computed with the old weights (SGLang)
    abort_all_requests: bool = False
    weight_version: str | None = None


WeightSource = UpdateWeightsFromDisk | UpdateWeightsFromTensors | UpdateWeightsFromDistributed


class UpdateWeights(msgspec.Struct, tag="update_weights"):
    source: WeightSource
    options: UpdateOptions = msgspec.field(default_factory=UpdateOptions)


class FinishWeightsUpdate(msgspec.Struct, tag="finish_weights_update", omit_defaults=True):
    """Commits (or rolls back) the update left open by finished=False."""

    commit: bool = True
    weight_version: str | None = None
    flush_cache: bool = True


class ReleaseMemory(msgspec.Struct, tag="sleep", omit_defaults=True):
    level: int | None = None  # 1: the KV cache; 2: the weights too
    tags: list[str] | None = None  # instead of level: weights, kv_cache, cuda_graph


class ResumeMemory(msgspec.Struct, tag="wake_up", omit_defaults=True):
    tags: list[str] | None = None  # none: all


class LoadLoraAdapter(msgspec.Struct, tag="load_lora_adapter", omit_defaults=True):
    """Serve an adapter as `name` (a new version of it when it is served already); `source` is
    the workers' load call (its slot chosen by the engine core), checked at the frontend."""

    name: str
    source: LoadLora
    version: str | None = None
    replace: bool = True  # False: a served name is refused (vLLM's load_inplace=false)
    pinned: bool = False  # never evicted from the workers (SGLang's pinned)
    stage: bool = False  # loaded, served only after FinishLoraLoad (--dp: all replicas or none)


class FinishLoraLoad(msgspec.Struct, tag="finish_lora_load"):
    """Serves the adapter staged as `name` (commit), or drops it."""

    name: str
    commit: bool


class UnloadLoraAdapter(msgspec.Struct, tag="unload_lora_adapter"):
    name: str


EngineControlOp = (
    GetStats
    | GetControlState
    | PauseGeneration
    | ResumeGeneration
    | ResetPrefixCache
    | UpdateWeights
    | FinishWeightsUpdate
    | InitWeightsUpdateGroup
    | DestroyWeightsUpdateGroup
    | ReleaseMemory
    | ResumeMemory
    | LoadLoraAdapter
    | FinishLoraLoad
    | UnloadLoraAdapter
)


# --------------------------------------------------------------------------- workers -> core


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    step_id: int
    req_ids: list[str]  # the requests that sampled this step, in batch order
    # Each one's new tokens: one, or with drafts the accepted drafts and the token after them.
    sampled_token_ids: list[list[int]]
    # For the requests that asked, by request id: the new tokens' logprobs (SamplingParams.
    # logprobs), and those of the prompt tokens this step's chunk predicts (prompt_logprobs).
    logprobs: dict[str, Logprobs] = {}
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    # Pooling models: by request id, the output of each request whose prompt ended this step
    # (EngineCoreOutput.pooled); such a request is finished. Nothing is sampled on these models.
    pooled: dict[str, list[float]] = {}
    # --enable-return-routed-experts: by request id, the experts each token of its chunk was
    # routed to, int16 (tokens, MoE layers, top_k) in native byte order.
    routed_experts: dict[str, bytes] = {}
    # Mixture-of-experts models: tokens each expert of each MoE layer took this step, flat
    # (layers x experts, layer-major).
    expert_tokens: list[int] = []
    # SamplingParams.cross_attention: by request id, float32 (tokens, heads, frames) rows of
    # each token of its chunk, native byte order.
    cross_attention: dict[str, bytes] = {}


class KVLayout(msgspec.Struct, array_like=True, frozen=True):
    """What a rank's KV blocks are: two servers exchange blocks only where these are equal."""

    model: str  # architecture and shape
    dtype: str
    block_size: int
    tp: int
    pp: int
    rank: int
    block_shape: list[int]  # one block of every layer of the rank's stage, as the rank stores it
    # Speculative decoding's draft model, whose own KV travels with the blocks when both servers
    # run the same one: its shape, one block's, its dtype ("": none, or a drafter whose KV does
    # not travel). Blocks are exchanged whatever the two say; drafts differ only in speed.
    draft: str = ""

    def blocks_agree(self, other: KVLayout) -> bool:
        """Whether the two ranks' blocks of the served model may be exchanged."""
        return msgspec.structs.replace(self, draft="") == msgspec.structs.replace(other, draft="")

    def drafts_agree(self, other: KVLayout) -> bool:
        """Whether the draft model's KV travels with the blocks: both run the same one."""
        return bool(self.draft) and self.draft == other.draft


class KVPull(msgspec.Struct, tag="kv_pull"):
    """A consumer -> a producer's worker rank: the rank's share of these blocks."""

    layout: KVLayout  # the consumer's rank's (the producer refuses another)
    block_ids: list[int]
    host: str  # the consumer's host: the same host gets the blocks in a shared-memory file
    state_checkpoint: int = -1  # hybrid models: the lease's state checkpoint, sent too


class KVPullReply(msgspec.Struct, tag="kv_blocks", omit_defaults=True):
    """The blocks, in the order asked: in `shm_path` (the same host; the reader deletes it) or
    in the reply's second frame; the state checkpoint's states (hybrid models) in
    `state_shm_path`, or the frame after."""

    error: str | None = None
    shm_path: str = ""
    num_bytes: int = 0
    state_shm_path: str = ""
    num_state_bytes: int = 0


class LeaseQuery(msgspec.Struct, tag="lease_query"):
    """A consumer -> a producer's bootstrap: where the blocks lent under `lease_id` are."""

    lease_id: str


class LeaseRelease(msgspec.Struct, tag="lease_release"):
    """A consumer -> a producer's bootstrap: it took the blocks, or gave up on them."""

    lease_id: str


class LeaseReply(msgspec.Struct, tag="lease", omit_defaults=True):
    """state: "ready" (the blocks below, on the ranks at `endpoints`), "pending" (not lent yet:
    ask again), "failed" (the producing request ended without lending: `error`)."""

    state: str
    block_ids: list[int] = []
    num_tokens: int = 0
    endpoints: list[str] = []  # by rank
    layouts: list[KVLayout] = []  # by rank
    token_ids: list[int] = []  # the producing request's prompt (the consumer checks its own)
    error: str | None = None
    other_block_ids: list[list[int]] = []  # the further KV-cache groups' (sliding windows)
    routing: bytes = b""  # --enable-return-routed-experts: the lent positions' routing rows
    # Hybrid models: the producer's checkpoint of the states after the prompt's last full block
    # before its last token (-1: none kept: the consumer cannot resume from the blocks).
    state_checkpoint: int = -1


BootstrapRequest = LeaseQuery | LeaseRelease


class WorkerReady(msgspec.Struct, tag="ready"):
    rank: int
    num_kv_blocks: int  # blocks that fit in --kv-cache-memory on this rank
    max_model_len: int
    vocab_size: int
    model_summary: str
    # The window of each KV-cache group (None: full attention); the same on every rank.
    kv_cache_windows: list[int | None] = msgspec.field(default_factory=lambda: [None])
    # Hybrid models' state checkpoints that fit on this rank, and their interval in tokens
    # (ModelRunner.plan_state_checkpoints).
    num_state_checkpoints: int = 0
    state_checkpoint_interval: int = 0
    # Mixture-of-experts models, from the driver: what a token's routing row holds.
    routing_shape: RoutingShape | None = None
    # --kv-transfer-config: where this rank lends its KV blocks, and what they are.
    kv_endpoint: str = ""
    kv_layout: KVLayout | None = None


class WorkerResult(msgspec.Struct, tag="result", omit_defaults=True):
    rank: int
    output: ModelRunnerOutput | None = None
    error: str | None = None  # the worker failed and exits: the engine fails
    # A control call (weight update, sleep) failed; the worker lives.
    control_error: str | None = None


WorkerReply = WorkerReady | WorkerResult


# --------------------------------------------------------------------------- nodes <-> core
# With --nnodes > 1, the worker launcher of every other node talks to node 0's executor over one
# ZMQ DEALER/ROUTER connection at --dist-init-addr: hello -> bootstrap, then heartbeats both ways.


class NodeHello(msgspec.Struct, tag="hello"):
    node_rank: int
    world_size: int  # tp x pp as this node was launched: must match node 0's


class NodeHeartbeat(msgspec.Struct, tag="heartbeat"):
    node_rank: int


class NodeWorkerExited(msgspec.Struct, tag="worker_exited"):
    """A worker of this node is gone: the engine must fail (its peers may hang in a collective)."""

    node_rank: int
    rank: int
    exitcode: int


NodeToCore = NodeHello | NodeHeartbeat | NodeWorkerExited


class NodeBootstrap(msgspec.Struct, tag="bootstrap", omit_defaults=True):
    """What a node's workers need to join: the step broadcast, the reply socket, the TCP store."""

    mq_handle: Handle
    reply_addr: str
    store_addr: str  # host:port of torch.distributed's TCP store
    error: str | None = None  # set instead when the node cannot join (mismatched launch)


class NodeAck(msgspec.Struct, tag="ack"):
    pass


class NodeStop(msgspec.Struct, tag="stop"):
    pass


CoreToNode = NodeBootstrap | NodeAck | NodeStop


class Codec:
    """msgpack encoder/decoder pair for one message type (decoders are typed, so input is validated)."""

    def __init__(self, typ: Any) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(typ)

    def encode(self, msg: Any) -> bytes:
        return self.encoder.encode(msg)

    def decode(self, data: bytes | memoryview) -> Any:
        return self.decoder.decode(data)
