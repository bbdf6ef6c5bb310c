"""torch's thread count per thread (kvstrata/engine/torch_threads.py): the KV store's threads set their own, and
a thread that steps the engine keeps the engine's; an engine's count where --threads does not give one."""

import os
import threading

import pytest
import torch

from kvstrata.config import EngineConfig
from kvstrata.engine.llm_engine import LLMEngine
from kvstrata.engine.torch_threads import default_threads, keep_torch_threads, use_torch_threads
from kvstrata.errors import KvstrataError


def in_new_thread(work):
    """What `work()` returns when run on a thread that has run no torch op yet."""
    result = []
    thread = threading.Thread(target=lambda: result.append(work()))
    thread.start()
    thread.join()
    return result[0]


def test_a_thread_s_count_stays_its_own_and_a_stepping_thread_keeps_its_count():
    before = torch.get_num_threads()
    try:
        use_torch_threads(2)
        assert in_new_thread(lambda: (use_torch_threads(1), torch.get_num_threads())[1]) == 1
        assert torch.get_num_threads() == 2  # this thread had taken its count before the other set one
        # A new thread takes the count the last thread set (why LLMEngine.step keeps its own)
        assert in_new_thread(torch.get_num_threads) == 1
        assert in_new_thread(lambda: (keep_torch_threads(2), torch.get_num_threads())[1]) == 2
    finally:
        use_torch_threads(before)


def test_an_engine_runs_on_omp_num_threads_where_set_else_on_the_cores_it_may_use(monkeypatch, tiny_llama):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB")).threads == 1
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", " 3 ")
        assert default_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's nesting levels: the outer one
        assert default_threads() == 4
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert default_threads() == len(os.sched_getaffinity(0))
        for bad in ("0", "two", "-1", "1.5", ",2"):
            monkeypatch.setenv("OMP_NUM_THREADS", bad)
            with pytest.raises(KvstrataError, match=f"OMP_NUM_THREADS={bad!r} does not start with a positive whole"):
                LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory="8MiB"))
    finally:
        use_torch_threads(before)
