"""Shared pytest setup: keep torch to one thread per test process (CI has 2 cores)."""

import torch

torch.set_num_threads(1)
