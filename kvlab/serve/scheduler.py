"""Continuous batching: which requests run this step, with how many tokens, in which blocks.

vLLM V1's policy in nano-vllm's shape. Each step, under a token budget: every running request in
admission order gets its next chunk (a decode token, or its next prefill chunk); a decode that
needs a new block and finds none preempts the newest running request (recompute: its blocks go
back, it returns to the head of the queue, and later re-prefills its prompt and the tokens it had
generated). Then waiting requests are admitted, oldest first, while the budget, ``max_num_seqs``
and the pool allow: a request is admitted when the pool can hold every block of its prefill,
allocated at once. An evicting method gives back its tail blocks when its prompt is in (the
engine's job, after the forward).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvlab.serve.layout import BlockLayout
from kvlab.serve.pool import BlockAllocator
from kvlab.serve.request import Request


@dataclass
class Sequence:
    """A request's state: its tokens, block table, and how much of it is in the cache."""

    request: Request
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    fed: int = 0  # logical tokens whose K/V is in the cache (the next chunk starts at this position)
    stored: int = 0  # slots those tokens fill (fewer than ``fed`` once the prompt is evicted)
    compressed: bool = False
    preemptions: int = 0
    recomputed_tokens: int = 0
    peak_blocks: int = 0
    first_scheduled_s: float | None = None
    window: list = field(default_factory=list)  # an evicting method's last prompt queries, per chunk per layer

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output

    def chunk_limit(self, layout: BlockLayout) -> int:
        """Tokens it can take next: the rest of its tokens, stopping at the prompt's end for an
        evicting method (the eviction runs on the whole prompt before anything is appended)."""
        end = len(self.tokens)
        if layout.evicts and not self.compressed and self.fed < self.prompt_len:
            end = self.prompt_len
        return end - self.fed

    def reset(self) -> None:
        """Back to nothing cached (preempted): its output stays and is recomputed on readmission."""
        self.recomputed_tokens += self.fed
        self.blocks, self.fed, self.stored, self.compressed, self.window = [], 0, 0, False, []
        self.preemptions += 1


class Scheduler:
    def __init__(self, layout: BlockLayout, allocator: BlockAllocator, max_num_seqs: int, max_batched_tokens: int):
        self.layout, self.allocator = layout, allocator
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions_total = 0

    def prefill_blocks(self, seq: Sequence) -> int:
        """Blocks its prefill holds at once: every token it will feed before it decodes."""
        upto = seq.prompt_len if self.layout.evicts else max(len(seq.tokens), 1)
        return self.layout.prefill_blocks(upto)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """This step's ``(sequence, tokens)`` pairs; blocks for them are allocated."""
        budget, batch = self.max_batched_tokens, []
        decoding_first = sorted(self.running, key=lambda s: s.chunk_limit(self.layout) != 1)  # stable
        for seq in decoding_first:
            if seq not in self.running:  # preempted by an earlier request's decode this step
                continue
            n = min(seq.chunk_limit(self.layout), budget)
            if n <= 0:
                continue
            if not self.reserve(seq, n):
                continue  # it preempted itself
            batch.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = self.prefill_blocks(seq)
            if need > self.allocator.free:
                break
            self.waiting.popleft()
            seq.blocks = self.allocator.allocate(need)
            seq.peak_blocks = max(seq.peak_blocks, len(seq.blocks))
            self.running.append(seq)
            n = min(seq.chunk_limit(self.layout), budget)
            batch.append((seq, n))
            budget -= n
        return batch

    def reserve(self, seq: Sequence, n: int) -> bool:
        """Blocks for ``n`` more slots, preempting the newest running requests until they fit."""
        need = self.layout.blocks_for(seq.stored + n) - len(seq.blocks)
        while need > self.allocator.free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.blocks += self.allocator.allocate(need)
            seq.peak_blocks = max(seq.peak_blocks, len(seq.blocks))
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.blocks)
        seq.reset()
        self.waiting.appendleft(seq)
        self.preemptions_total += 1

    def shrink(self, seq: Sequence) -> None:
        """Give back the blocks past its stored slots (after an eviction compacted them)."""
        keep = self.layout.blocks_for(seq.stored)
        self.allocator.release(seq.blocks[keep:])
        seq.blocks = seq.blocks[:keep]

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.blocks)
        seq.blocks = []
