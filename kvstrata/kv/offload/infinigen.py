"""`--kv-offload infinigen` (papers/infinigen.md §2): the full KV in the host pool; each layer's decode reads
only the tokens speculated one layer ahead.

The compute device keeps, per layer, the partial (skewed) key of every cached token: K̃ = K·A restricted to
the skew's heaviest columns (kv/offload/skew.py), written whenever K is. At layer i−1's input the policy asks
the model for layer i's queries of that input (`layer_queries`, supplied from above kv/), turns them with the
same partial A, scores them against layer i's partial keys, picks tokens (kv/offload/speculation.py), gathers
those rows per KV head in the host pool and copies them to the device (on the CPU a float pool's rows are gathered
straight into the device buffers: one pass). Layer i then attends exactly over them plus the step's new token.
Layers below `full_layers` and every prefill chunk read their full KV, as `full` does. Nothing is evicted: every
token stays in the host pool and may be picked again later.

On the CPU, scoring and picking are one compiled call per layer (kv/kernels/infinigen_select.cpp, the float16
partial keys read where they lie) and layer i attends over its fetched rows with a compiled kernel
(fetched_attention.cpp); the torch path (speculation.py, fetch_plan.attend_over_plan) is their reference and runs
on other devices, with --no-paged-kernel and for keys without block tables. What is fetched is laid out per KV head
without padding each sequence (kv/offload/fetch_plan.py).

On a CUDA device the host gathers the chosen rows (it needs the plan, so it waits for the speculation) and their
copy to the GPU is issued on a side stream, staged in pinned memory; layer i−1's attention and FFN, queued after
it, run while it is in flight, and layer i's attention waits for its event (papers/infinigen.md §3: the authors'
code orders the two the same way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from kvstrata.errors import KvstrataError
from kvstrata.kv.attention_batch import AttentionBatch, AttentionGroup, CachedKeys
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.offload.fetch_plan import FetchPlan, attend_over_plan, own_rows_of, plan_from_selection, runs_of
from kvstrata.kv.offload.full_offload import FullOffload
from kvstrata.kv.offload.host_pool import HostPoolCap
from kvstrata.kv.offload.partial_keys import PartialKeys
from kvstrata.kv.offload.skew import InfiniGenSkew
from kvstrata.kv.offload.speculation import Selection, select_tokens
from kvstrata.kv.offload.transfers import OffloadStats, to_device, to_host
from kvstrata.kv.preloaded import Preloaded
from kvstrata.kv.slots import slots_of_positions
from kvstrata.kv.storage import KVStorage

# (layer i, the input x [T, hidden] of layer i-1, positions [T]) -> layer i's queries [T, heads, D] after RoPE
LayerQueries = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class InfiniGenSettings:
    alpha: float = 5.0  # keep tokens whose speculated logit is above max - alpha (the paper: 5 for Llama-2)
    partial_ratio: float = 0.3  # share of each head's skewed channels kept in the partial keys
    max_fraction: float = 0.2  # at most this share of a sequence's cached tokens per layer
    full_layers: int = 2  # layers 0 .. full_layers-1 read their full KV (the authors' code: 2)
    recent: int = 32  # the newest cached tokens every speculated layer also reads (ours; the paper: 0)
    diagnostics: bool = False  # also compute full attention and count the mass the fetched tokens hold

    def __post_init__(self) -> None:
        if not self.alpha > 0:
            raise KvstrataError(f"infinigen_alpha {self.alpha!r} must be positive (inf keeps every token)")
        if not 0 < self.partial_ratio <= 1:
            raise KvstrataError(f"infinigen_partial_ratio {self.partial_ratio!r} must be in (0, 1]")
        if not 0 < self.max_fraction <= 1:
            raise KvstrataError(f"infinigen_max_fraction {self.max_fraction!r} must be in (0, 1]")
        if not isinstance(self.recent, int) or self.recent < 0:
            raise KvstrataError(f"infinigen_recent {self.recent!r} must be a whole number of tokens, 0 or more")
        if not isinstance(self.full_layers, int) or self.full_layers < 1:
            raise KvstrataError(f"infinigen_full_layers {self.full_layers!r} must be at least 1 (layer 0 has no "
                                "layer before it to speculate from)")


@dataclass
class Fetched:
    """What the previous layer's input fetched for one decode group: K and V [kv_heads, R, D] on the device, laid
    out as `plan` (on the host) says, each sequence's own token last among its rows, filled in at attention;
    `offsets`, the plan's, on the device; on a GPU, the event after the copy on the side stream."""

    k: torch.Tensor
    v: torch.Tensor
    plan: FetchPlan
    offsets: torch.Tensor
    copied: torch.cuda.Event | None = None


class DecodesOfStep:
    """What every speculated layer of a step reads about its decode group, made once per step at first use: else
    every layer would launch the same small operators again and, on a GPU, wait for the device to read values
    back."""

    def __init__(self, group: AttentionGroup, recent: int):
        self.group = group  # held, so that the group's id is not reused during the step
        self._recent = recent

    @cached_property
    def q_positions_on_host(self) -> torch.Tensor:
        return self.group.q_positions[:, 0].cpu()

    @cached_property
    def cached_tokens(self) -> int:
        return int(self.group.context_lens.sum())

    @cached_property
    def cached(self) -> torch.Tensor:
        """bool [n, Tk] on the device: the keys cached before each sequence's new token."""
        positions, q_positions = self.group.keys.positions, self.group.q_positions[:, 0]
        return (positions >= 0) & (positions < q_positions[:, None])

    @cached_property
    def recent(self) -> torch.Tensor | None:
        """bool [n, Tk] on the device: the newest `recent` positions of each sequence (None: no window)."""
        if not self._recent:
            return None
        return self.group.keys.positions >= (self.group.q_positions[:, 0] - self._recent)[:, None]


class InfiniGenAttention(FullOffload):
    def __init__(self, storage: KVStorage, device: torch.device, row_bytes: float, stats: OffloadStats,
                 skew: InfiniGenSkew, layer_queries: LayerQueries, settings: InfiniGenSettings, num_slots: int,
                 cap: HostPoolCap | None = None, compiled_kernels: bool = True):
        # on the CPU the speculation and the attention over what it fetched run compiled where the kernels build
        # (off: --no-paged-kernel)
        super().__init__(storage, device, row_bytes, stats, compiled_kernels)
        self.cap = cap  # --kv-host-memory: what the host pool may hold
        if skew.rotation.shape[:3] != (storage.num_layers, *storage.kv_shape):
            raise KvstrataError(f"the infinigen skew has shape {list(skew.rotation.shape[:3])} (layers, KV heads, "
                                f"head dim); the model's cache has {[storage.num_layers, *storage.kv_shape]}")
        self.settings = settings
        self.layer_queries = layer_queries
        self.partial_rotation = skew.partial_rotation(settings.partial_ratio).to(device)  # [L, G, D, r]
        layers, kv_heads, dim, partial = self.partial_rotation.shape
        self.query_rotation = self.partial_rotation * dim**-0.5  # turns queries into partial ones scaled as logits
        self.partial_keys = PartialKeys(layers, kv_heads, num_slots, partial, storage.block_size, device)
        self._fetched: dict[int, dict[int, Fetched]] = {}  # layer -> id of a decode group of the step -> its fetch
        self._decodes: dict[int, DecodesOfStep] = {}  # id of a decode group of the step -> what its layers read
        self._step_places: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's slots in the partial keys
        self.fetch_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def begin_step(self, batch: AttentionBatch) -> None:
        super().begin_step(batch)
        self._fetched.clear()
        self._decodes.clear()
        self._step_places = None
        if self.cap is not None:
            self.cap.begin_step()

    def attach_block_pool(self, pool: BlockPool) -> None:
        super().attach_block_pool(pool)
        if self.cap is not None:
            self.cap.attach_block_pool(pool)

    def reset_blocks(self, blocks: list[int]) -> None:
        super().reset_blocks(blocks)
        if self.cap is not None:
            self.cap.reset_blocks(blocks)

    def after_store(self, layer: int, batch: AttentionBatch, k_new: torch.Tensor) -> None:
        if self._step_places is None:
            self._step_places = self.partial_keys.places(batch.slot_mapping.to(self.device))
        self._store_partial_keys(layer, self._step_places, k_new)
        if self.cap is not None:
            self.cap.stored(layer, self.step_on_host(batch)[0])

    def fetch(self, layer: int, keys: CachedKeys, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().fetch(layer, keys, dtype)
        if self.cap is not None:
            on_host = self.keys_on_host(keys)
            self.cap.fetched(layer, on_host.slots[on_host.positions >= 0].unique())
        return k, v

    def readable(self, layer: int, keys: CachedKeys) -> torch.Tensor | None:
        if self.cap is None:
            return None
        return ~to_device(self.cap.dead[layer][self.keys_on_host(keys).slots], self.device)

    def _store_partial_keys(self, layer: int, places: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor) -> None:
        """The partial keys of k [T, kv_heads, D], the tokens at `places` (PartialKeys.places)."""
        partial = torch.bmm(k.to(self.device, torch.float32).transpose(0, 1), self.partial_rotation[layer])
        self.partial_keys.write(layer, places, partial)

    def write(self, block_table: list[int], kv: Preloaded, first: int, end: int) -> None:
        """Preloaded KV goes to the host pool; its partial keys, made from what the pool holds, to the device."""
        super().write(block_table, kv, first, end)
        slots = slots_of_positions(torch.tensor([block_table]), torch.arange(first, end), self.storage.block_size)[0]
        places = self.partial_keys.places(slots.to(self.device))
        for layer in range(self.storage.num_layers):
            self._store_partial_keys(layer, places, self.storage.read(layer, block_table, end, first)[0])

    def on_layer_input(self, layer: int, x: torch.Tensor, batch: AttentionBatch) -> None:
        target = layer + 1
        if target < self.settings.full_layers or target >= self.storage.num_layers:
            return
        self._fetched[target] = {id(group): self._speculate(target, x[group.rows], group)
                                 for group in batch.groups if group.is_decode}

    def _decodes_of_step(self, group: AttentionGroup) -> DecodesOfStep:
        decodes = self._decodes.get(id(group))
        if decodes is None:
            decodes = self._decodes[id(group)] = DecodesOfStep(group, self.settings.recent)
        return decodes

    def _speculate(self, layer: int, x: torch.Tensor, group: AttentionGroup) -> Fetched:
        q_positions = group.q_positions[:, 0]
        q = self.layer_queries(layer, x, q_positions).float()  # [n, heads, D]
        n, heads, dim = q.shape
        kv_heads = self.partial_rotation.shape[1]
        q_partial = q.view(n, kv_heads, heads // kv_heads, dim) @ self.query_rotation[layer]  # [n, G, group, r]
        if self.kernel is not None and group.keys.block_tables is not None:
            plan = self._select_in_place(layer, q_partial, group)
        else:
            plan = self._select(layer, q_partial.transpose(0, 1), group)
        # two buffers in turn: layer i's fetch must outlive layer i+1's, made before layer i attends
        buffer = f"speculated{layer % 2}"
        gathered = self._gather_into_device_buffers(layer, plan, buffer)
        if gathered is None:  # the plan is on the host, which gathers its rows
            k, v = (rows[:, 0] for rows in self.storage.gather_per_head(layer, plan.slots[:, None],
                                                                        plan.positions[:, None], x.dtype))
        else:
            k, v = gathered
        if self.cap is not None:
            self.cap.fetched(layer, plan.slots[plan.chosen_rows()].unique())
        rows = int(plan.offsets[:, -1].sum()) - n * kv_heads  # each sequence's last row, its own token, is not fetched
        self.stats.fetched(layer, k.nbytes + v.nbytes, round(rows * self.row_bytes))
        self.stats.decode_rows(layer, fetched=rows, cached=self._decodes_of_step(group).cached_tokens * kv_heads)
        self.stats.selected_per_head[layer] += int(plan.per_query_head.sum())
        self.stats.decodes[layer] += n
        offsets = to_device(plan.offsets, self.device)
        if gathered is not None:
            return Fetched(k.to(x.dtype), v.to(x.dtype), plan, offsets)
        names = (f"{buffer}.k", f"{buffer}.v")
        if self.fetch_stream is None:
            return Fetched(*self.stats.copy_to(self.buffers, names, k, v), plan, offsets)
        # the buffers' last reader, layer i-2's attention, is queued on the compute stream: the copy comes after it
        self.fetch_stream.wait_stream(torch.cuda.current_stream(self.device))
        k, v = self.stats.copy_to(self.buffers, names, k, v, stream=self.fetch_stream)
        return Fetched(k, v, plan, offsets, self.fetch_stream.record_event())

    def _gather_into_device_buffers(self, layer: int, plan: FetchPlan,
                                    buffer: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """On the CPU, where host and device are one memory, a float pool's rows of `plan` gathered straight into
        the device buffers `buffer`.k and .v: host work, standing for the gather and the copy both (the modeled
        step adds the link's time for the rows on top); None elsewhere (gathered, then copied)."""
        if self.device.type != "cpu":
            return None
        return self.storage.copy_stored_rows(layer, plan.slots, lambda name, shape, dtype: self.buffers.empty(
            f"{buffer}.{name}", shape, dtype))

    def _select(self, layer: int, q_partial: torch.Tensor, group: AttentionGroup) -> FetchPlan:
        """The torch path: q_partial [G, n, group, r]; every cached token's partial key gathered, then scored on the
        device; the choice comes back to the host (one wait on a GPU), which makes the plan."""
        keys, decodes, on_host = group.keys, self._decodes_of_step(group), self.keys_on_host(group.keys)
        partial_keys = (self.partial_keys.of_slots(layer, keys.slots) if keys.block_tables is None
                        else self.partial_keys.of_blocks(layer, keys.block_tables))  # [G, n, Tk, r]
        scores = q_partial @ partial_keys.transpose(-1, -2)  # [G, n, group, Tk]
        cached = decodes.cached
        if self.cap is not None:  # tokens the capped pool gave up are not there to fetch
            cached = cached & ~to_device(self.cap.dead[layer][on_host.slots], self.device)
        selection = select_tokens(scores, cached, self.settings.alpha, self.settings.max_fraction, decodes.recent)
        chosen, per_query_head = to_host(self.storage.device, selection.chosen, selection.per_query_head)
        return plan_from_selection(Selection(chosen, per_query_head), on_host.slots, on_host.positions,
                                   decodes.q_positions_on_host)

    def _select_in_place(self, layer: int, q_partial: torch.Tensor, group: AttentionGroup) -> FetchPlan:
        """The compiled path (kv/kernels/infinigen_select.cpp): the same choice, the partial keys read where they
        lie through the block tables."""
        dead = self.cap.dead[layer] if self.cap is not None else torch.empty(0, dtype=torch.bool)
        with torch.profiler.record_function("kvstrata::infinigen_select"):  # named in profiles
            return FetchPlan(*self.kernel.infinigen_select(
                q_partial, self.partial_keys.data[layer], group.keys.block_tables, group.q_positions[:, 0], dead,
                self.storage.block_size, self.settings.alpha, self.settings.max_fraction, self.settings.recent))

    def attend_group(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     group: AttentionGroup) -> torch.Tensor:
        fetched = self._fetched.get(layer, {}).get(id(group))
        if fetched is None:
            return super().attend_group(layer, q, k_new, v_new, group)
        if fetched.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(fetched.copied)
        # the fetched tokens plus, in each sequence's last row, the step's own, which is on the device already
        k, v, plan = fetched.k, fetched.v, fetched.plan
        own = (torch.arange(k.shape[0], device=k.device)[:, None], own_rows_of(fetched.offsets))
        k[own] = k_new.transpose(0, 1)
        v[own] = v_new.transpose(0, 1)
        if self.settings.diagnostics:
            self._count_recall(layer, q, group, plan)
        if self.kernel is not None and q.dtype == torch.float32:
            with torch.profiler.record_function("kvstrata::fetched_attention"):  # named in profiles
                return self.kernel.fetched_attention(q, k, v, *runs_of(plan.offsets), q.shape[-1] ** -0.5)
        return attend_over_plan(q, k, v, fetched.offsets, plan.widest_run)

    def _count_recall(self, layer: int, queries: torch.Tensor, group: AttentionGroup, plan: FetchPlan) -> None:
        """Diagnostics: the share of each query head's true attention mass (over every cached key) that falls on
        the tokens its KV head fetched plus the step's own token. The full keys are read without being counted;
        the engine gives decodes whole-block keys, whose column is their position."""
        k, _ = self.storage.gather_keys(layer, self.keys_on_host(group.keys), queries.dtype)
        n, heads, dim = queries.shape
        kv_heads = k.shape[2]
        grouped = queries.view(n, kv_heads, heads // kv_heads, dim).transpose(0, 1).float()
        scores = grouped @ k.permute(2, 0, 3, 1).to(self.device).float() * dim**-0.5  # [G, n, group, Tk]
        mask = group.keys.mask_for(group)  # [n, 1, Tk]
        probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
        chosen = plan.chosen_mask(scores.shape[-1]).to(self.device)
        own = group.keys.positions == group.q_positions  # the step's token
        chosen = torch.maximum(chosen, own[None].float())
        self.stats.recall_mass += float((probs * chosen[:, :, None]).sum())
        self.stats.recall_heads += kv_heads * n * probs.shape[2]
