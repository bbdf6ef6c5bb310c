"""Freed memory kept for the next step (kvstrata/engine/freed_memory.py), seen in the page faults of a process that
takes, writes and frees the same buffers step after step, after setting up an engine with the option and without."""

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="only glibc's malloc is set")

# A step's buffers: 12, 12, 4 and 3 MiB, held together, written, then freed; the faults of ten steps after three
# first ones, in which the heap settles around the engine's own blocks. Before the engine, the process maps blocks
# from 128 KiB on, glibc's starting default, fixed: left to itself glibc raises that threshold after freeing a large
# mapped block, and whether the steps then fault depends on what the imports happened to free and leave behind.
BUFFER_FLOATS = (3 * 2**20, 3 * 2**20, 2**20, 3 * 2**18)
STEPS = f"""
import ctypes, resource, sys, torch
from kvstrata.config import EngineConfig
from kvstrata.engine.freed_memory import M_MMAP_THRESHOLD
from kvstrata.engine.llm_engine import LLMEngine
ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 128 * 1024)
LLMEngine(EngineConfig(model=sys.argv[1], kv_cache_memory="2MiB", threads=1, keep_freed_memory=sys.argv[2] == "on"))
def step():
    held = [torch.empty(n).fill_(1.0) for n in {BUFFER_FLOATS}]
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_WRITTEN = 10 * sum(BUFFER_FLOATS) * 4 // 4096


def faults_of_ten_steps(model, option: str) -> int:
    result = subprocess.run([sys.executable, "-c", STEPS, str(model), option], capture_output=True, text=True,
                            check=True, timeout=300)
    return int(result.stdout.split()[-1])


def test_an_engine_has_freed_buffers_kept_for_the_next_step(tiny_llama):
    assert faults_of_ten_steps(tiny_llama, "on") < PAGES_WRITTEN // 5  # at most a settling step or two


def test_without_the_option_the_same_steps_fault_their_pages_in_again(tiny_llama):
    assert faults_of_ten_steps(tiny_llama, "off") > PAGES_WRITTEN // 2
