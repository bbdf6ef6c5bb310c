"""torch's thread count per thread (kvstrata/engine/torch_threads.py): the KV store's threads set their own, and
a thread that steps the engine keeps the engine's."""

import threading

import torch

from kvstrata.engine.torch_threads import keep_torch_threads, use_torch_threads


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
