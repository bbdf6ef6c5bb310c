from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.sequence import Sequence
from kvstrata.kv.block_hash import chained_block_hash, full_block_hashes
from kvstrata.kv.block_pool import BlockPool
from kvstrata.kv.cache_manager import KVCacheManager


def seq(tokens, seq_id=0):
    return Sequence(seq_id, str(seq_id), None, list(tokens), SamplingParams())


def test_chained_hash_depends_on_everything_before():
    a = full_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, [])
    b = full_block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, [])
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert a[1] == chained_block_hash(a[0], [5, 6, 7, 8])
    assert full_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, a[:1]) == a  # extends a known prefix


def test_free_blocks_without_cache_go_first_and_cached_ones_are_evicted_lru():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    assert pool.num_free == 0
    pool.register(blocks[0], b"h0")
    pool.register(blocks[1], b"h1")
    pool.release(blocks[0])  # cached, freed first: least recently used
    pool.release(blocks[1])  # cached
    pool.release(blocks[2])  # holds nothing cached: handed out before any cached block
    assert pool.allocate() == blocks[2]
    assert pool.allocate() == blocks[0]  # evicts h0
    assert pool.lookup(b"h0") is None and pool.lookup(b"h1") == blocks[1]


def test_forgetting_the_free_blocks_leaves_held_ones_cached():
    pool = BlockPool(3)
    held, freed, plain = (pool.allocate() for _ in range(3))
    pool.register(held, b"held")
    pool.register(freed, b"freed")
    pool.release(freed)
    pool.release(plain)
    assert pool.forget_free() == 1
    assert pool.lookup(b"freed") is None and pool.lookup(b"held") == held
    assert pool.num_free == 2


def test_shared_blocks_count_references():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.register(block, b"h")
    pool.share(block)
    pool.release(block)
    assert pool.num_free == 1  # still referenced once
    pool.release(block)
    assert pool.num_free == 2 and pool.lookup(b"h") == block  # free but still cached
    pool.share(block)
    assert pool.num_free == 1


def test_prefix_match_reuses_blocks_and_leaves_one_token_to_compute():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first = seq(range(12))
    assert manager.match_prefix(first) == 0
    assert manager.grow(first, 12)
    first.num_computed_tokens = 12
    manager.commit(first, 12)
    same = seq(range(12), seq_id=1)
    # All 12 tokens are cached, but the last block is left to compute so the step yields logits.
    assert manager.match_prefix(same) == 8
    assert same.block_table == first.block_table[:2]
    longer = seq(list(range(12)) + [99], seq_id=2)
    assert manager.match_prefix(longer) == 12


def test_grow_refuses_without_changing_anything_when_short():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    s = seq(range(6))
    assert manager.grow(s, 6) and len(s.block_table) == 2
    other = seq(range(3), seq_id=1)
    assert not manager.grow(other, 3) and other.block_table == []
    manager.free(s)
    assert manager.pool.num_free == 2 and s.block_table == []


def test_every_allocation_is_reported_and_shared_blocks_are_not():
    seen = []
    manager = KVCacheManager(num_blocks=3, block_size=4, on_allocate=seen.extend)
    s = seq(range(9))
    manager.grow(s, 9)
    s.num_computed_tokens = 9
    manager.commit(s, 9)
    manager.free(s)
    assert sorted(seen) == [0, 1, 2]
    again = seq(range(9), seq_id=1)
    assert manager.match_prefix(again) == 8  # two cached blocks shared, not handed out anew
    manager.grow(again, 1)
    assert len(seen) == 4  # one block allocated for the last token


def test_blocks_behind_a_sliding_window_go_back_to_the_pool_and_stay_cached():
    """A query at position p reads keys p - window + 1 .. p: the blocks wholly before the next query's window are given
    back (their entries repeat the first block kept), stay findable in the prefix cache until handed out again, and
    are not released a second time when the sequence is freed. A prefix matched later attaches only the blocks its
    next query reads."""
    manager = KVCacheManager(num_blocks=8, block_size=4, window=6)
    s = seq(range(100, 117))  # 17 tokens in 5 blocks
    manager.grow(s, 17)
    s.num_computed_tokens = 17
    manager.commit(s, 17)
    blocks = list(s.block_table)
    manager.release_behind_window(s)  # the next query, at 17, reads 12 .. 17: blocks 0-2 are behind it
    assert s.block_table == [blocks[3]] * 4 + [blocks[4]] and s.num_released_blocks == 3
    assert manager.pool.num_used == 2 and manager.held_blocks(s) == blocks[3:]
    manager.release_behind_window(s)  # nothing more behind it: nothing released twice
    assert manager.pool.num_used == 2

    other = seq(range(100, 113), seq_id=1)  # its next query, at 12, reads 7 .. 12: block 0 is behind it
    assert manager.match_prefix(other) == 12 and other.block_table == [blocks[1]] + blocks[1:3]
    assert other.num_released_blocks == 1 and manager.pool.ref_counts[blocks[0]] == 0
    manager.free(s)
    assert manager.pool.num_used == 2 and min(manager.pool.ref_counts) == 0
    assert (s.block_table, s.num_released_blocks) == ([], 0)
    manager.free(other)
    assert manager.pool.num_used == 0


def test_under_a_sliding_window_a_prefix_whose_head_was_handed_out_is_still_matched():
    """The head of a windowed prefix goes back to the pool first (given back as its sequence moves on), so it is
    the first cached block handed out again; the prefix still matches as far as the blocks its next query reads
    are cached. Without a window it matches nothing once its first block is gone."""

    def computed(window):
        manager = KVCacheManager(num_blocks=5, block_size=4, window=window)
        s = seq(range(100, 117))  # 17 tokens in 5 blocks
        manager.grow(s, 17)
        s.num_computed_tokens = 17
        manager.commit(s, 17)
        blocks = list(s.block_table)
        manager.release_behind_window(s)
        manager.free(s)
        return manager, blocks

    manager, blocks = computed(window=6)
    newcomer = seq(range(500, 506), seq_id=1)
    manager.grow(newcomer, 6)  # the last block (never cached), then the least recently freed: the head
    assert newcomer.block_table == [blocks[4], blocks[0]]
    again = seq(range(100, 117), seq_id=2)
    # usable: the 4 blocks before the last token; a query at 16 reads 11 .. 16: blocks 2 and 3
    assert manager.match_prefix(again) == 16
    assert again.block_table == [blocks[2]] * 2 + blocks[2:4] and again.num_released_blocks == 2
    assert [manager.pool.ref_counts[b] for b in blocks] == [1, 0, 1, 1, 1]  # the newcomer's and again's

    manager, blocks = computed(window=None)
    manager.pool.forget(blocks[0])
    assert manager.match_prefix(seq(range(100, 117), seq_id=2)) == 0


def test_under_a_sliding_window_a_prefix_is_matched_only_where_its_next_query_reads_cached_blocks():
    """A gap in the blocks that a query would read ends the prefix before it: of 6 usable blocks with block 4 gone,
    under a window of 6 a query at 24 reads blocks 4-5, at 20 blocks 3-4, at 16 blocks 2-3: 16 tokens match."""
    manager = KVCacheManager(num_blocks=8, block_size=4, window=6)
    s = seq(range(100, 125))  # 25 tokens in 7 blocks
    manager.grow(s, 25)
    s.num_computed_tokens = 25
    manager.commit(s, 25)
    manager.pool.forget(s.block_table[4])
    manager.free(s)
    again = seq(range(100, 125), seq_id=1)
    assert manager.match_prefix(again) == 16 and again.num_released_blocks == 2


def test_a_discarded_sequence_takes_the_blocks_it_gave_back_out_of_the_prefix_cache():
    manager = KVCacheManager(num_blocks=8, block_size=4, window=4)
    s = seq(range(12))
    manager.grow(s, 12)
    s.num_computed_tokens = 12
    manager.commit(s, 12)
    manager.release_behind_window(s)
    assert s.num_released_blocks == 2 and manager.pool.lookup(s.block_hashes[0]) is not None
    manager.discard(s)
    assert all(manager.pool.lookup(h) is None for h in s.block_hashes)
