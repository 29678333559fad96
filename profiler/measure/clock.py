"""Timestamps at hook points: wall clock on the CPU, device events on an accelerator.

On an accelerator a host timestamp only measures kernel launches, so each mark records an event on the
current stream and times are read once per step, after one synchronize.
"""

from __future__ import annotations

import time

import torch


class WallClock:
    """CPU: ops run synchronously on the calling thread, and autograd runs backward on that thread too."""

    def mark(self) -> float:
        return time.perf_counter()

    def synchronize(self) -> None:
        pass

    @staticmethod
    def elapsed_ms(start: float, end: float) -> float:
        return (end - start) * 1e3


class EventClock:
    """CUDA and other accelerators (through `torch.accelerator`): timing events on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.Event:
        event = torch.Event(device=self.device, enable_timing=True)
        event.record()
        return event

    def synchronize(self) -> None:
        torch.accelerator.synchronize(self.device)

    @staticmethod
    def elapsed_ms(start: torch.Event, end: torch.Event) -> float:
        return start.elapsed_time(end)


class DeviceMemory:
    """The caching allocator's counters on an accelerator (the CPU has none: see `cpu_memory.CpuMemory`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return torch.accelerator.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.accelerator.max_memory_allocated(self.device)

    def forget(self, tensor: torch.Tensor) -> None:
        """Nothing: the allocator's counters cannot leave one tensor out (`CpuMemory.forget` does), so a
        parameter's new gradient stays in the working set here, on the safe side."""


def device_of(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def clock_for(device: torch.device) -> WallClock | EventClock:
    return WallClock() if device.type == "cpu" else EventClock(device)


def memory_for(device: torch.device) -> DeviceMemory | None:
    return None if device.type == "cpu" else DeviceMemory(device)
