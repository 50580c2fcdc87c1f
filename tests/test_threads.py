"""threads.py: the decode steps' thread count follows their measured times (a machine shared with others)."""

from __future__ import annotations

import time

import torch

from openflash.threads import StepThreads


def test_decode_steps_move_to_one_thread_where_it_is_faster_and_torch_s_count_is_kept() -> None:
    """A step that is slow at torch's count (as with a core busy elsewhere) and fast at one thread: after the
    first probe round the steps run at one thread, torch's own count is put back after each, and a batch size
    of its own is measured apart."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads = StepThreads()
        seen = []

        def step() -> int:
            seen.append(torch.get_num_threads())
            time.sleep(0.02 if torch.get_num_threads() > 1 else 0.001)
            return len(seen)

        for _ in range(10):
            threads.run(1, step)
            assert torch.get_num_threads() == 2
        assert seen[-5:] == [1] * 5 and 2 in seen
        seen.clear()
        threads.run(4, step)
        assert seen == [2]  # a new batch size starts at torch's count
        torch.set_num_threads(1)
        seen.clear()
        threads.run(1, step)
        assert seen == [1]  # one thread in all: nothing to choose
    finally:
        torch.set_num_threads(before)
