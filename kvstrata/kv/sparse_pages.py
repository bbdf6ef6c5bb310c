"""Variable-length per-token bytes (Oaken's outlier entries) in pages allocated on demand.

Two tables, as in the paper's MMU (papers/oaken.md §4), in software: each cache block owns a list
of sparse pages (block -> pages), and each token slot has an (offset, count) entry locating its
bytes in its block's pages. A token's bytes may straddle a page boundary: offsets are logical,
within the block, and pages translate them. Pages go back to the free list when the block is
handed out again, or when the tokens that filled them are discarded (a sequence's rejected drafts).
The pool starts at the size the budget expects and grows if the data hold more outliers than that, so
nothing is ever dropped; `grown_pages` counts such growth. Each layer's free pages are a stack in a
tensor, so that the compiled writers (kv/kernels/sparse_write.cpp) take pages themselves.
"""

from __future__ import annotations

import torch

from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.slots import block_slots


class SparsePages:
    TABLE_BYTES = 6  # per token slot: int32 offset + int16 count

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, page_bytes: int, initial_pages: int,
                 max_bytes_per_token: int, device: torch.device):
        self.block_size = block_size
        self.page_bytes = page_bytes
        self.num_pages = max(initial_pages, 1)
        self.data = torch.zeros(num_layers, self.num_pages * page_bytes, dtype=torch.uint8, device=device)
        max_pages = -(-block_size * max_bytes_per_token // page_bytes)
        self.block_pages = torch.full((num_layers, num_blocks, max_pages), -1, dtype=torch.long, device=device)
        self.block_fill = torch.zeros(num_layers, num_blocks, dtype=torch.long, device=device)
        self.token_offset = torch.zeros(num_layers, num_blocks * block_size, dtype=torch.int32, device=device)
        self.token_count = torch.zeros(num_layers, num_blocks * block_size, dtype=torch.int16, device=device)
        # layer l's free pages: the first free_count[l] entries of free_stack[l], the one handed out next last
        self.free_stack = torch.arange(self.num_pages - 1, -1, -1, device=device).repeat(num_layers, 1)
        self.free_count = torch.full((num_layers,), self.num_pages, dtype=torch.long, device=device)
        self.grown_pages = 0
        self._writer_views: dict[int, list[torch.Tensor]] = {}
        # on the CPU, writes go through the compiled writer (if it builds): the same result, without the dozens of
        # small operations per layer and step
        self.compiled = paged_decode.kernel() if device.type == "cpu" else None
        # per layer, a number of free pages the GPU writer may take without asking the device (append_on_gpu); it
        # stays low after `release` frees pages (a lower bound still) until the writer next asks the device
        self.free_at_least = [self.num_pages] * num_layers

    def grown_bytes(self) -> int:
        """Bytes of pages added beyond the initial pool, over all layers."""
        return self.grown_pages * self.page_bytes * self.data.shape[0]

    def pages_in_use(self) -> int:
        return self.num_pages * len(self.free_count) - int(self.free_count.sum())

    def free_pages(self, layer: int) -> list[int]:
        """Layer `layer`'s free pages, the one handed out next last."""
        return self.free_stack[layer, : int(self.free_count[layer])].tolist()

    def release(self, blocks: list[int]) -> None:
        index = torch.tensor(blocks, dtype=torch.long, device=self.data.device)
        owned = self.block_pages[:, index]  # [layers, blocks, page entries], -1: no page
        self._push_free(owned.flatten(1), owned.flatten(1) >= 0)
        self.block_pages[:, index] = -1
        self.block_fill[:, index] = 0
        self.token_count[:, block_slots(index, self.block_size)] = 0

    def discard(self, slots: torch.Tensor) -> None:
        """Forget the bytes of the tokens at `slots`, which must be the last written to their blocks (a sequence's
        rejected drafts; nothing checks it): every layer's block fill goes back to where the first of them began, so
        the tokens written there next take their place instead of following them, and pages past the fill go back to
        the free stack (a block owns the pages its fill needs and no more, which the GPU writer counts on). On a GPU
        this waits for the device (the blocks' `unique`, the masks' indexing): once a step, and only where drafts
        were rejected."""
        starts = self.token_offset[:, slots].long()  # [layers, n]
        blocks = slots // self.block_size
        self.block_fill.scatter_reduce_(1, blocks.expand_as(starts), starts, reduce="amin")
        self.token_count[:, slots] = 0
        touched = blocks.unique()
        owned = self.block_pages[:, touched]  # [layers, blocks, page entries]
        needed = -(-self.block_fill[:, touched] // self.page_bytes)
        spare = (torch.arange(owned.shape[2], device=owned.device) >= needed[..., None]) & (owned >= 0)
        self._push_free(owned.flatten(1), spare.flatten(1))
        self.block_pages[:, touched] = owned.masked_fill(spare, -1)

    def _push_free(self, pages: torch.Tensor, chosen: torch.Tensor) -> None:
        """Put the `chosen` of `pages` [layers, X] on top of their layer's free stack, in order; all layers in a few
        operations, since this runs for every batch of blocks handed out."""
        places = self.free_count[:, None] + chosen.cumsum(1) - 1
        layers = torch.arange(len(pages), device=pages.device)[:, None].expand_as(pages)
        self.free_stack[layers[chosen], places[chosen]] = pages[chosen]
        self.free_count += chosen.sum(1)

    def write(self, layer: int, slots: torch.Tensor, data: torch.Tensor, counts: torch.Tensor) -> None:
        """Append each token's `counts[i]` bytes (taken in order from `data`) to its block's pages.
        Tokens of one block arrive in slot order within a call, as a sequence's tokens do."""
        self.free_at_least[layer] = 0  # these writers take pages the GPU writer's bound does not count
        if self.compiled is not None:
            self._write_compiled(layer, slots, data, counts)
            return
        blocks = slots // self.block_size
        ends = counts.cumsum(0)
        starts = ends - counts
        run_blocks, run_lengths = torch.unique_consecutive(blocks, return_counts=True)
        run_first = run_lengths.cumsum(0) - run_lengths
        run_bytes = ends[run_first + run_lengths - 1] - starts[run_first]
        base = self.block_fill[layer, run_blocks]
        self._ensure_pages(layer, run_blocks, -(-(base + run_bytes) // self.page_bytes))
        self.block_fill[layer, run_blocks] = base + run_bytes
        # offset of each token in its block = the block's fill before the call + bytes of earlier tokens of the run
        run_of_token = torch.repeat_interleave(torch.arange(len(run_blocks), device=slots.device), run_lengths)
        offsets = base[run_of_token] + starts - starts[run_first][run_of_token]
        self.token_offset[layer, slots] = offsets.int()
        self.token_count[layer, slots] = counts.to(torch.int16)
        if data.numel():
            self.data[layer, self._physical(layer, blocks, offsets, counts)] = data

    def append_on_gpu(self, layer: int, slots: torch.Tensor, entries: torch.Tensor, entry_bytes: torch.Tensor) -> None:
        """`write` by the GPU kernel (kv/gpu/sparse_append.py): token i's bytes are the first entry_bytes[i] of
        entries[i]. The kernel takes pages without checking the stack, so the layer must hold what the call can need
        first. The host keeps a lower bound of each layer's free pages and checks it against the worst case (every
        token at its most bytes), which needs no wait for the device. Only where the bound falls short does it wait,
        once, for the true free counts and the call's bytes, and bound the need by those: a block needs at most one
        page beyond its share of the bytes. The pool grows where the free pages fall short of that bound (and so
        perhaps by a page per block more than the call's exact need; `grown_pages` counts it)."""
        from kvstrata.kv.gpu import sparse_append  # imports Triton: only where the GPU kernels run

        worst = len(slots) * -(-entries.shape[1] // self.page_bytes)
        if self.free_at_least[layer] < worst:
            blocks = slots // self.block_size  # a block's tokens lie next to each other: count its runs
            call = torch.stack((entry_bytes.sum(dtype=torch.long), (blocks[1:] != blocks[:-1]).sum() + 1))
            *self.free_at_least, total_bytes, runs = torch.cat((self.free_count, call)).tolist()
            worst = -(-total_bytes // self.page_bytes) + runs
            if self.free_at_least[layer] < worst:
                self.grow(worst - self.free_at_least[layer])
        self.free_at_least[layer] -= worst
        sparse_append.sparse_append(self.writer_tensors(layer), slots, entries, entry_bytes, self.block_size,
                                    self.page_bytes)

    def _write_compiled(self, layer: int, slots: torch.Tensor, data: torch.Tensor, counts: torch.Tensor) -> None:
        """`write` by kv/kernels/sparse_write.cpp, which takes the pages it needs from the layer's free stack; where
        that holds too few it writes nothing and says how many more it needs."""
        slots, data, counts = slots.contiguous(), data.contiguous(), counts.long().contiguous()
        while short := self.compiled.sparse_write(self.writer_tensors(layer), slots, data, counts, self.block_size,
                                                  self.page_bytes):
            self.grow(short)

    def writer_tensors(self, layer: int) -> list[torch.Tensor]:
        """One layer's pages as the compiled writers take them: data, block -> pages, block fill, token offsets, token
        counts, free-page stack and count. Kept per layer (every layer's store asks for them) until the pool grows."""
        if layer not in self._writer_views:
            self._writer_views[layer] = [self.data[layer], self.block_pages[layer], self.block_fill[layer],
                                         self.token_offset[layer], self.token_count[layer], self.free_stack[layer],
                                         self.free_count[layer : layer + 1]]
        return self._writer_views[layer]

    def layer_tensors(self, layer: int) -> list[torch.Tensor]:
        """One layer's pages as the compiled readers take them: data, block -> pages, token offsets, token counts."""
        data, block_pages, _, token_offset, token_count, _, _ = self.writer_tensors(layer)
        return [data, block_pages, token_offset, token_count]

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The bytes of the tokens at `slots`, token after token."""
        counts = self.token_count[layer, slots].long()
        offsets = self.token_offset[layer, slots].long()
        return self.data[layer, self._physical(layer, slots // self.block_size, offsets, counts)]

    def _physical(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        token = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
        firsts = counts.cumsum(0) - counts
        logical = offsets[token] + torch.arange(len(token), device=counts.device) - firsts[token]
        pages = self.block_pages[layer, blocks[token], logical // self.page_bytes]
        return pages * self.page_bytes + logical % self.page_bytes

    def _ensure_pages(self, layer: int, blocks: torch.Tensor, needed: torch.Tensor) -> None:
        """Blocks own at least `needed` pages each."""
        owned = (self.block_pages[layer, blocks] >= 0).sum(dim=1)
        for block, have, need in zip(blocks.tolist(), owned.tolist(), needed.tolist()):
            for page_index in range(have, need):
                self.block_pages[layer, block, page_index] = self._take_page(layer)

    def _take_page(self, layer: int) -> int:
        if not int(self.free_count[layer]):
            self.grow()
        self.free_count[layer] -= 1
        return int(self.free_stack[layer, self.free_count[layer]])

    def grow(self, at_least: int = 1) -> None:
        """A quarter more pages in every layer (at least `at_least`), free."""
        extra = max(self.num_pages // 4, at_least)
        device = self.data.device
        more = torch.zeros(self.data.shape[0], extra * self.page_bytes, dtype=torch.uint8, device=device)
        self.data = torch.cat((self.data, more), dim=1)
        with torch.inference_mode(False):  # a normal tensor, which `release` may change outside a step
            stack = torch.empty(len(self.free_count), self.num_pages + extra, dtype=torch.long, device=device)
            stack[:, : self.num_pages] = self.free_stack
            new_pages = torch.arange(self.num_pages + extra - 1, self.num_pages - 1, -1, device=device)
            for layer, free in enumerate(self.free_count.tolist()):
                stack[layer, free : free + extra] = new_pages
        self.free_stack = stack
        self._writer_views.clear()
        self.free_count += extra
        self.free_at_least = [free + extra for free in self.free_at_least]
        self.num_pages += extra
        self.grown_pages += extra
