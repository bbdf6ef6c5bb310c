"""The compiled paged decode-attention kernel (kv/kernels/paged_decode.cpp) against the reference attention."""

import os
import time

import pytest
import torch

from kvstrata import compiled_extension
from kvstrata.kv.attention_batch import whole_block_keys
from kvstrata.kv.cache_factory import CacheShape, FormatOptions, storage_layout
from kvstrata.kv.formats.float8 import Float8Format
from kvstrata.kv.kernels import paged_decode
from kvstrata.kv.reference_attention import attend

KERNEL = paged_decode.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C++ compiler: the kernel could not be built")


def random_pools(kv_heads=3, num_blocks=40, block=16, dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(kv_heads, num_blocks, block, dim, generator=gen),
            torch.randn(kv_heads, num_blocks, block, dim, generator=gen))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "dim"), [(3, 64), (9, 64), (9, 72), (3, 20)])
def test_kernel_equals_the_reference_attention_over_the_gathered_blocks(heads, dim, dtype):
    """Sequences of different lengths (one token, a block and one, full blocks) in padded tables, with MHA and GQA:
    the kernel's output equals the reference attention over the same blocks gathered by hand. Head sizes: 64 and 72
    (rows are read head by head, in slabs of 64 values and a rest), 20 (not a whole number of vectors: token by token
    and value by value). float32 pools are read where they lie, float16 ones widened a tile of tokens at a time."""
    k_pool, v_pool = (pool.to(dtype).float() for pool in random_pools(dim=dim))  # values float16 can hold
    lens = torch.tensor([1, 17, 48, 100])
    width = 7
    gen = torch.Generator().manual_seed(1)
    order = torch.randperm(40, generator=gen)
    tables = torch.stack([order[i * width : (i + 1) * width] for i in range(4)])
    q = torch.randn(4, heads, dim, generator=gen)
    got = KERNEL.paged_decode_attention(q, k_pool.to(dtype), v_pool.to(dtype), tables, lens, dim**-0.5)
    keys = whole_block_keys(tables, lens, 16)
    k = k_pool[:, tables].flatten(2, 3).permute(1, 2, 0, 3)  # [n, tokens, kv_heads, dim]
    v = v_pool[:, tables].flatten(2, 3).permute(1, 2, 0, 3)
    want = attend(q[:, None], k, v, (keys.positions != -1)[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize(("lens", "window"), [([1, 17, 48, 100], 16), ([1, 17, 48, 100], 1), ([600], 300),
                                              ([600], 37)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_window_attends_each_row_s_last_tokens(lens, window, dtype):
    """With a sliding window the kernel equals the reference attention over each row's last `window` tokens (all of a
    shorter row's): rows of one part each (four sequences), and a lone long row split into parts from its window's
    first token (on 2 threads)."""
    num_blocks = 40
    k_pool, v_pool = (pool.to(dtype).float() for pool in random_pools(num_blocks=num_blocks))
    lens = torch.tensor(lens)
    gen = torch.Generator().manual_seed(2)
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[: -(-int(lens.max()) // 16)] for _ in lens])
    q = torch.randn(len(lens), 9, 64, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = KERNEL.paged_decode_attention(q, k_pool.to(dtype), v_pool.to(dtype), tables, lens, 64**-0.5, 0, window)
        everything = KERNEL.paged_decode_attention(q, k_pool.to(dtype), v_pool.to(dtype), tables, lens, 64**-0.5)
    finally:
        torch.set_num_threads(threads)
    keys = whole_block_keys(tables, lens, 16)
    k = k_pool[:, tables].flatten(2, 3).permute(1, 2, 0, 3)
    v = v_pool[:, tables].flatten(2, 3).permute(1, 2, 0, 3)
    in_window = (keys.positions != -1) & (keys.positions >= (lens - window)[:, None])
    want = attend(q[:, None], k, v, in_window[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[-1], everything[-1], atol=1e-3)  # the window left keys out


def record_format(name: str, kv_heads: int, dim: int):
    """A record format as the engine builds it for --kv-format `name` (int4 in groups of 32)."""
    shape = CacheShape(num_layers=1, num_kv_heads=kv_heads, head_dim=dim, block_size=16)
    return storage_layout(name, shape, FormatOptions(int4_group_size=32)).format


@needs_kernel
@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e5m2", "int4", "int8/int4", "int4/fp8"])
def test_record_kernel_equals_the_reference_attention_over_the_decoded_records(name):
    """Over per-token records (one-byte codes and a float16 scale: int8, fp8, fp8_e5m2; int4's groups; K and V in
    two of them), the kernel equals the reference attention over the K/V the format decodes from the same records,
    for GQA and sequences of mixed lengths; its whole-block read gives those K/V."""
    kv_heads, dim, block, num_blocks = 3, 64, 16, 12
    fmt = record_format(name, kv_heads, dim)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(num_blocks * block, kv_heads * dim, generator=gen) * 3
    v = torch.randn(num_blocks * block, kv_heads * dim, generator=gen)
    positions = torch.arange(num_blocks * block)
    records = {"k": fmt.encode(k, 0, "k", positions).dense, "v": fmt.encode(v, 0, "v", positions).dense}
    lens = torch.tensor([1, 20, 64])
    tables = torch.tensor([[5, 0, 0, 0], [2, 7, 0, 0], [11, 3, 8, 1]])
    q = torch.randn(3, 9, dim, generator=gen)
    got = fmt.attend_in_place(KERNEL, 0, q, records, {}, tables, lens, block)
    keys = whole_block_keys(tables, lens, block)
    k_dec, v_dec = (fmt.decode(records[kind][keys.slots.reshape(-1)], None, 0, kind, None).view(3, -1, kv_heads, dim)
                    for kind in "kv")
    want = attend(q[:, None], k_dec, v_dec, (keys.positions != -1)[:, None])[:, 0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    read_k, read_v = fmt.read_in_place(KERNEL, 0, records, {}, tables, lens, block)
    real = (keys.positions != -1)[..., None]
    torch.testing.assert_close(read_k, torch.where(real, k_dec.flatten(2), 0), rtol=0, atol=0)
    torch.testing.assert_close(read_v, torch.where(real, v_dec.flatten(2), 0), rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("form", ["fp8", "fp8_e5m2"])
def test_the_float8_reader_gives_every_codes_value(form):
    """All 256 codes in one record (subnormals, both zeros, e5m2's infinities and NaNs) read as the torch decoder
    reads them, at a scale of 3; e4m3fn's NaN codes excepted (the reader widens them to 480 x scale; the encoder
    writes them only beside a NaN scale)."""
    fmt = Float8Format(256, form)
    scale = torch.tensor([3.0], dtype=torch.float16).view(torch.uint8)
    records = torch.cat((torch.arange(256, dtype=torch.uint8), scale))[None].expand(16, -1).contiguous()
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.tensor([1])
    got = KERNEL.paged_read_records(records, records, tables, lens, 16, 4, 64, form, 0, form, 0)[0][0, 0]
    want = fmt.decode(records[:1], None, 0, "k", None)[0]
    checked = torch.ones(256, dtype=torch.bool)
    if form == "fp8":
        checked[[0x7F, 0xFF]] = False
    torch.testing.assert_close(got[checked], want[checked], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(got[checked].signbit(), want[checked].signbit())


@needs_kernel
def test_a_record_reader_refuses_unknown_forms_and_mismatched_records_by_name():
    records = torch.zeros(16, 3 * 64 + 2, dtype=torch.uint8)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.tensor([4])
    with pytest.raises(RuntimeError, match="paged_read_records: record form 'fp4'; int8, fp8, fp8_e5m2 or int4"):
        KERNEL.paged_read_records(records, records, tables, lens, 16, 3, 64, "int8", 0, "fp4", 0)
    with pytest.raises(RuntimeError, match="paged_read_records: V records of 194 bytes, int4's are 120"):
        KERNEL.paged_read_records(records, records, tables, lens, 16, 3, 64, "int8", 0, "int4", 32)
    with pytest.raises(RuntimeError, match="paged_read_records: int4 records need a positive group size, got 0"):
        KERNEL.paged_read_records(records, records, tables, lens, 16, 3, 64, "int4", 0, "int8", 0)


@needs_kernel
@pytest.mark.parametrize("lone_len", [40, 150, 600])
def test_rows_sharing_a_block_table_attend_as_their_sequence_alone(lone_len):
    """Speculative decoding's rows: one sequence's last token and three drafts, rows with one block table and lengths
    lone_len .. lone_len + 3. Each row's output is bit for bit what the row gives decoded alone, beside another
    sequence too (then as the two alone)."""
    k_pool, v_pool = random_pools()
    gen = torch.Generator().manual_seed(2)
    table = torch.randperm(40, generator=gen)[:39].reshape(1, 39)
    lens = torch.arange(lone_len, lone_len + 4)
    q = torch.randn(4, 9, 64, generator=gen)
    together = KERNEL.paged_decode_attention(q, k_pool, v_pool, table.expand(4, 39), lens, 0.125)
    for row in range(4):
        alone = KERNEL.paged_decode_attention(q[row : row + 1], k_pool, v_pool, table, lens[row : row + 1], 0.125)
        assert torch.equal(together[row], alone[0])
    other = torch.randperm(40, generator=gen)[:39].reshape(1, 39)
    with_other = KERNEL.paged_decode_attention(torch.cat([q, q[:1]]), k_pool, v_pool,
                                               torch.cat([table.expand(4, 39), other]),
                                               torch.cat([lens, torch.tensor([300])]), 0.125)
    pair = KERNEL.paged_decode_attention(torch.cat([q[:1], q[:1]]), k_pool, v_pool, torch.cat([table, other]),
                                         torch.tensor([lone_len, 300]), 0.125)
    assert torch.equal(with_other[0], pair[0]) and torch.equal(with_other[4], pair[1])


@needs_kernel
def test_a_row_attends_alike_whatever_else_the_step_holds():
    """Rows of 40, 150, 520 and 600 tokens, each decoded alone, in pairs and all four together on 2 threads: bit for
    bit the same output. Rows of 512 tokens or more are split over the threads as alone (a lone sequence's tokens
    need splitting to keep the threads busy), shorter ones never, so a greedy request's decode does not change as
    other requests come and go."""
    k_pool, v_pool = random_pools()
    gen = torch.Generator().manual_seed(3)
    tables = torch.stack([torch.randperm(40, generator=gen)[:38] for _ in range(4)])
    lens, q = torch.tensor([40, 150, 520, 600]), torch.randn(4, 9, 64, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = [KERNEL.paged_decode_attention(q[[row]], k_pool, v_pool, tables[[row]], lens[[row]], 0.125)[0]
                 for row in range(4)]
        together = KERNEL.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125)
        pairs = [KERNEL.paged_decode_attention(q[list(rows)], k_pool, v_pool, tables[list(rows)], lens[list(rows)],
                                               0.125) for rows in ((0, 2), (3, 1))]
    finally:
        torch.set_num_threads(threads)
    for row in range(4):
        assert torch.equal(together[row], alone[row]), row
    assert all(torch.equal(pairs[0][i], alone[row]) for i, row in enumerate((0, 2)))
    assert all(torch.equal(pairs[1][i], alone[row]) for i, row in enumerate((3, 1)))


def tables_sharing_a_prefix(sequences: int, shared_blocks: int, own_lens: list[int], seed: int = 6):
    """Block tables of `sequences` rows whose first shared_blocks blocks are the same, then blocks of their own, with
    context lengths shared_blocks x 16 + own_lens[row] (a row of own length 0 holds the prefix alone)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(40, generator=gen)
    own_blocks = max(-(-n // 16) for n in own_lens)
    own = [order[shared_blocks + row * own_blocks :][:own_blocks] for row in range(sequences)]
    tables = torch.stack([torch.cat([order[:shared_blocks], blocks]) for blocks in own])
    return tables, torch.tensor([shared_blocks * 16 + n for n in own_lens])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_prefix_shared_by_eight_sequences_is_read_once_with_the_same_result(dtype, threads):
    """Eight sequences whose tables begin with the same 4 blocks (64 tokens, and one of them holds nothing else):
    with min_shared_tokens 64 the kernel reads that prefix once for all (the count of prefixes so read goes up) and
    gives what it gives reading each sequence's copy, to float rounding; the rows of one sequence's drafts count as
    one sequence, so seven sequences and a draft are too few; a prefix shorter than asked is read per sequence."""
    k_pool, v_pool = (pool.to(dtype) for pool in random_pools(num_blocks=40))
    tables, lens = tables_sharing_a_prefix(8, 4, [0, 1, 5, 16, 17, 30, 31, 3])
    q = torch.randn(8, 9, 64, generator=torch.Generator().manual_seed(7))
    before_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain = KERNEL.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125)
        reads = KERNEL.shared_prefix_reads()
        shared = KERNEL.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125, 64)
        assert KERNEL.shared_prefix_reads() == reads + 1
        torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-6)
        drafted = tables.clone()
        drafted[7] = drafted[6]  # row 7: a draft of row 6's sequence
        assert torch.equal(KERNEL.paged_decode_attention(q, k_pool, v_pool, drafted, lens, 0.125, 64),
                           KERNEL.paged_decode_attention(q, k_pool, v_pool, drafted, lens, 0.125))
        assert torch.equal(KERNEL.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125, 80), plain)
        assert KERNEL.shared_prefix_reads() == reads + 1
    finally:
        torch.set_num_threads(before_threads)


@needs_kernel
def test_the_shared_prefix_is_the_blocks_every_row_holds_within_its_context():
    """Nine rows that share 3 blocks, then a fourth that all but the last hold: asked for 48 tokens, the nine read
    their 48 once; asked for 49, the eight that hold 4 blocks read those 64 tokens once and the last its own copy;
    the result is the per-sequence one. A prefix of 300 tokens in 19 blocks shares the 18 whole ones (288 tokens),
    read in chunks."""
    k_pool, v_pool = random_pools(num_blocks=40)
    tables, lens = tables_sharing_a_prefix(9, 4, [2, 9, 20, 1, 7, 16, 3, 12, 5])
    tables[8, 3] = tables[8, 4]  # row 8's fourth block is one of its own
    q = torch.randn(9, 9, 64, generator=torch.Generator().manual_seed(8))
    plain = KERNEL.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125)
    reads = KERNEL.shared_prefix_reads()
    torch.testing.assert_close(KERNEL.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125, 48), plain,
                               rtol=1e-5, atol=1e-6)
    assert KERNEL.shared_prefix_reads() == reads + 1
    torch.testing.assert_close(KERNEL.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125, 49), plain,
                               rtol=1e-5, atol=1e-6)
    assert KERNEL.shared_prefix_reads() == reads + 2
    k_pool, v_pool = random_pools(num_blocks=60)
    gen = torch.Generator().manual_seed(9)
    order = torch.randperm(60, generator=gen)
    long_tables = torch.stack([torch.cat([order[:19], order[19 + 4 * row :][:4]]) for row in range(8)])
    long_lens = torch.tensor([300 + 7 * row for row in range(8)])
    q = torch.randn(8, 9, 64, generator=gen)
    torch.testing.assert_close(KERNEL.paged_decode_attention(q, k_pool, v_pool, long_tables, long_lens, 0.125, 256),
                               KERNEL.paged_decode_attention(q, k_pool, v_pool, long_tables, long_lens, 0.125),
                               rtol=1e-5, atol=1e-6)
    assert KERNEL.shared_prefix_reads() == reads + 3


@needs_kernel
def test_each_prefix_eight_sequences_share_is_read_once_and_the_other_rows_as_before():
    """A step of 8 sequences over one document (4 blocks), 9 over another (3 blocks), a lone sequence of its own and
    7 over a third (2 blocks), interleaved, every one beginning with the same block (a chat template's system
    prompt), and two drafts of sequences over the first document: the two documents of 8 or more sequences are read
    once each, and every row's output is what reading each sequence's copy gives."""
    k_pool, v_pool = random_pools(num_blocks=160)
    gen = torch.Generator().manual_seed(10)
    order = torch.randperm(160, generator=gen).tolist()
    system = order[:1]
    documents = [system + order[1:4], system + order[4:7], system + order[7:8]]
    spare = iter(order[8:])
    rows = [0] * 8 + [1] * 9 + [None] + [2] * 7
    rows = [rows[i] for i in torch.randperm(len(rows), generator=gen).tolist()]
    tables, lens = [], []
    for document in rows:
        shared = documents[document] if document is not None else system
        tables.append(shared + [next(spare) for _ in range(6 - len(shared))])
        lens.append(16 * len(shared) + int(torch.randint(1, 30, (1,), generator=gen)))
    drafts = [row for row, document in enumerate(rows) if document == 0][:2]
    tables += [tables[row] for row in drafts]
    lens += [lens[row] + 1 for row in drafts]
    tables, lens = torch.tensor(tables), torch.tensor(lens)
    q = torch.randn(len(tables), 9, 64, generator=gen)
    plain = KERNEL.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125)
    reads = KERNEL.shared_prefix_reads()
    torch.testing.assert_close(KERNEL.paged_decode_attention(q, k_pool, v_pool, tables, lens, 0.125, 32), plain,
                               rtol=1e-5, atol=1e-6)
    assert KERNEL.shared_prefix_reads() == reads + 2


@needs_kernel
def test_kernel_refuses_out_of_range_blocks_and_lengths():
    k_pool, v_pool = random_pools()
    q = torch.randn(1, 3, 64)
    with pytest.raises(RuntimeError, match="block id out of range"):
        KERNEL.paged_decode_attention(q, k_pool, v_pool, torch.tensor([[40]]), torch.tensor([5]), 0.125)
    with pytest.raises(RuntimeError, match="context length out of range"):
        KERNEL.paged_decode_attention(q, k_pool, v_pool, torch.tensor([[3]]), torch.tensor([17]), 0.125)


def test_a_lock_left_by_a_killed_build_is_removed_and_a_recent_one_kept(tmp_path):
    """torch waits forever on a build's lock file; one far older than a build takes must not hang every start."""
    lock = tmp_path / "lock"
    lock.touch()
    compiled_extension.clear_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running now
    old = time.time() - compiled_extension.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="did not finish"):
        compiled_extension.clear_stale_lock(tmp_path)
    assert not lock.exists()
    compiled_extension.clear_stale_lock(tmp_path)  # nothing there: nothing to do


def test_a_load_that_compiles_says_so_and_one_found_built_is_silent(monkeypatch, capsys):
    """A first run compiles for minutes: without a word it looked like a hang."""
    monkeypatch.setattr(compiled_extension, "BUILD_NOTICE_AFTER_S", 0.0)  # every load "outlasts" it
    said = ""
    with compiled_extension._building_notice("weight kernels"):
        deadline = time.monotonic() + 60
        while "compiling" not in said and time.monotonic() < deadline:
            time.sleep(0.01)
            said += capsys.readouterr().err
    said += capsys.readouterr().err
    assert "kvstrata: compiling the weight kernels" in said and "kvstrata: compiled the weight kernels in" in said
    monkeypatch.setattr(compiled_extension, "BUILD_NOTICE_AFTER_S", 60.0)
    with compiled_extension._building_notice("weight kernels"):
        pass
    assert capsys.readouterr().err == ""


def test_a_changed_header_beside_a_source_changes_the_build_flags(tmp_path):
    """torch rebuilds on changed sources or flags only; a kernel whose header changed must not load stale."""
    source, header = tmp_path / "kernel.cpp", tmp_path / "rows.h"
    source.write_text('#include "rows.h"\n')
    header.write_text("int rows = 4;\n")
    before = compiled_extension.header_flag([source])
    assert compiled_extension.header_flag([source]) == before
    header.write_text("int rows = 8;\n")
    assert compiled_extension.header_flag([source]) != before


def test_every_kernel_source_is_built_by_one_extension():
    """The set-up builds EXTENSIONS: a source missing from them would be left out of every build."""
    listed = [source for _, sources in compiled_extension.EXTENSIONS.values() for source in sources]
    root = compiled_extension.KVSTRATA
    assert sorted(listed) == sorted(str(path.relative_to(root)) for path in root.glob("*/**/kernels/*.cpp"))
