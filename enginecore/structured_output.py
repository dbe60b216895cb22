"""Structured output in the engine core: grammars compiled off the step loop, one matcher per request.

xgrammar does the work. The model's tokenizer info is built once, on the compile thread, the first
time a constrained request arrives (loading the tokenizer and xgrammar takes a second or two that
the step loop must not wait for); compiled grammars are cached by xgrammar's compiler, bounded in
bytes. Each step, a constrained request that samples gets its allowed-token bitmask computed from
its matcher while the workers run the forward pass, sent right after the step (GrammarBitmasks) to
the sampling rank; each token it samples then advances the matcher. Preemption keeps the matcher:
the request keeps its output tokens, so the matcher is already in the state the resumed request
continues from.

With a reasoning model the constraint starts after the reasoning: tokens up to and including
`reasoning_end_token_ids` pass unconstrained.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from enginecore.json_grammar import bound_any_json_grammar, bound_schema_grammar
from enginecore.messages import StructuredOutputKind, StructuredOutputSpec

if TYPE_CHECKING:
    import torch
    import xgrammar

logger = logging.getLogger("tern.engine")

GRAMMAR_CACHE_BYTES = 256 << 20


class GrammarCompiler:
    """Compiles StructuredOutputSpecs on one background thread; results are cached by xgrammar."""

    def __init__(
        self, tokenizer_path: str | Path, vocab_size: int, bound_json_numbers: bool = True
    ) -> None:
        self.tokenizer_path = str(tokenizer_path)
        self.vocab_size = vocab_size
        self.bound_json_numbers = bound_json_numbers  # enginecore/json_grammar.py
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._bitmask: torch.Tensor | None = None  # (1, words) int32, filled on the step loop

    def submit(self, spec: StructuredOutputSpec, stop_token_ids: list[int]) -> Future[Any]:
        """A future of the compiled grammar. `stop_token_ids` (the model's EOS ids, the same for
        every request) end a grammar's output; they are read on the first call only."""
        return self._pool.submit(self._compile, spec, list(stop_token_ids))

    def _compile(self, spec: StructuredOutputSpec, stop_token_ids: list[int]) -> Any:
        compiler = self._get_compiler(stop_token_ids)
        kind = spec.kind
        if kind == StructuredOutputKind.JSON:
            grammar = json_schema_grammar(spec.spec, spec.any_whitespace, self.bound_json_numbers)
            return compiler.compile_grammar(grammar)
        if kind == StructuredOutputKind.JSON_OBJECT:
            grammar = any_json_grammar(spec.any_whitespace, self.bound_json_numbers)
            return compiler.compile_grammar(grammar)
        if kind == StructuredOutputKind.REGEX:
            return compiler.compile_regex(spec.spec)
        if kind == StructuredOutputKind.GRAMMAR:
            return compiler.compile_grammar(spec.spec)
        if kind == StructuredOutputKind.STRUCTURAL_TAG:
            return compiler.compile_structural_tag(*structural_tag_args(spec.spec))
        raise ValueError(f"unknown structured output kind {kind!r}")

    def _get_compiler(self, stop_token_ids: list[int]) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import torch
                import xgrammar as xgr
                from transformers import AutoTokenizer

                # NOTE: the engine core shares the cores with the workers; the bitmask tensor
                # needs no torch threads.
                torch.set_num_threads(1)
                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=GRAMMAR_CACHE_BYTES
                )
                self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
            return self._compiler

    def fill_bitmask(self, matcher: xgrammar.GrammarMatcher) -> bytes:
        """The matcher's allowed next tokens, packed (see messages.GrammarBitmasks)."""
        assert self._bitmask is not None, "a matcher exists only after a compile"
        matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask.numpy().tobytes()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@functools.lru_cache(maxsize=256)
def json_schema_grammar(schema: str, any_whitespace: bool, bound_numbers: bool = True) -> str:
    """The EBNF grammar of a JSON schema (xgrammar's), strict JSON, with numbers and whitespace
    bounded and its strings' characters valid (enginecore/json_grammar.py). Raises on a bad
    schema."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=any_whitespace, max_whitespace_cnt=_XGRAMMAR_WHITESPACE
    )
    return bound_schema_grammar(str(grammar), bound_numbers)


@functools.lru_cache(maxsize=4)
def any_json_grammar(any_whitespace: bool, bound_numbers: bool = True) -> str:
    """The EBNF grammar of any JSON object or array (json_object), bounded as schemas are."""
    import xgrammar as xgr

    text = str(xgr.Grammar.builtin_json_grammar())
    return bound_any_json_grammar(text, bound_numbers, any_whitespace)


# Whitespace runs as xgrammar writes them (a rule repeated 0..n times), then rewritten.
_XGRAMMAR_WHITESPACE = 17


def structural_tag_args(spec: str) -> tuple[Any, ...]:
    """The arguments of xgrammar's structural-tag constructors for vLLM's tag, in either form:
    {"structures": [{begin, schema, end}], "triggers"} (the original: (items, triggers)), or
    xgrammar's {"type": "structural_tag", "format": {...}} (the JSON text itself)."""
    import xgrammar as xgr

    tag = json.loads(spec)
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(
                begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"]
            )
            for s in tag["structures"]
        ]
        return items, tag.get("triggers", [])
    return (spec,)


class RequestGrammar:
    """One request's matcher, and whether the constraint has started (after the reasoning)."""

    def __init__(self, compiled: Any, compiler: GrammarCompiler, reasoning_end: list[int]) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.compiler = compiler
        self.reasoning_end = list(reasoning_end)
        self.is_active = not self.reasoning_end
        self._recent: list[int] = []  # the last output tokens, while the reasoning goes on

    @property
    def is_terminated(self) -> bool:
        """The grammar's output is complete and its stop token was sampled."""
        return self.is_active and self.matcher.is_terminated()

    def bitmask(self) -> bytes:
        """The allowed next tokens (the constraint must have started: is_active)."""
        assert self.is_active, "no constraint during the reasoning"
        return self.compiler.fill_bitmask(self.matcher)

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading drafts the grammar accepts without completing (the matcher is left
        as it was): a draft that would end the output is left for the sampler to choose."""
        if not self.is_active:
            return 0
        accepted = 0
        for t in token_ids:
            if not self.matcher.accept_token(t):
                break
            accepted += 1
            if self.matcher.is_terminated():
                break
        ending = accepted > 0 and self.matcher.is_terminated()
        if accepted:
            self.matcher.rollback(accepted)
        return accepted - int(ending)

    def bitmasks_along(self, token_ids: list[int]) -> bytes:
        """The bitmask now and after each of `token_ids` (valid drafts: valid_prefix of them all),
        concatenated."""
        parts = [self.bitmask()]
        for t in token_ids:
            accepted = self.matcher.accept_token(t)
            assert accepted, "drafts are checked with valid_prefix when they are scheduled"
            parts.append(self.bitmask())
        if token_ids:
            self.matcher.rollback(len(token_ids))
        return b"".join(parts)

    def accept(self, token_id: int) -> bool:
        """Advances the matcher by a sampled token; False if the grammar does not allow it."""
        if self.is_active:
            return bool(self.matcher.accept_token(token_id))
        self._recent.append(token_id)
        n = len(self.reasoning_end)
        del self._recent[:-n]
        self.is_active = self._recent == self.reasoning_end
        return True
