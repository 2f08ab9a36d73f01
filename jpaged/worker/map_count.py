"""Linux's cap on a process's memory mappings, checked before each compile.

On XLA:CPU every compiled program maps its generated code in many small pieces: about 500
mappings per step program of the demo model (measured: 499-526 each, docs/serving.md). Linux
caps a process at vm.max_map_count mappings (65,530 by default), so about 130 programs fill
it, and the compile (or any later mmap) that passes the cap aborts the whole process (LLVM:
"Unable to allocate section memory", SIGABRT), every request in flight with it. MapBudget
checks the process's mappings before a compile and raises MapCountError instead, with what to
change; a step that raises it fails like any failed step (the engine rebuilds its state and
serves on) and a precompile that raises it stops start-up with that one line.

    budget = MapBudget()
    budget.check("step program X")   # before compiling: raises MapCountError near the cap
    budget.record(before)            # after compiling: learns how many mappings one adds
"""

from __future__ import annotations

MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
SELF_MAPS = "/proc/self/maps"
MIN_MARGIN = 1024  # mappings kept free before a compile: twice a demo step program's ~500


class MapCountError(OSError):
    """A compile could take the process past vm.max_map_count."""


def map_usage(
    maps_path: str = SELF_MAPS, limit_path: str = MAX_MAP_COUNT
) -> tuple[int, int] | None:
    """(memory mappings of this process, vm.max_map_count), or None where /proc does not
    say (not Linux)."""
    try:
        with open(limit_path) as f:
            limit = int(f.read())
        with open(maps_path, "rb") as f:
            count = f.read().count(b"\n")
    except (OSError, ValueError):
        return None
    return count, limit


class MapBudget:
    """The mappings one compile may add, learned from the compiles so far (their largest
    increase, times 1.5, at least MIN_MARGIN), and the check before the next one."""

    def __init__(self, usage=map_usage) -> None:
        self._usage = usage
        self.largest_increase = 0  # mappings added by the largest compile so far

    @property
    def margin(self) -> int:
        return max(MIN_MARGIN, 3 * self.largest_increase // 2)

    def check(self, what: str) -> tuple[int, int] | None:
        """Raises MapCountError if compiling `what` could pass the cap; returns the usage
        now (for record) or None where it is unknown."""
        usage = self._usage()
        if usage is None:
            return None
        count, limit = usage
        if count + self.margin > limit:
            raise MapCountError(
                f"not compiling {what}: this process has {count} memory mappings, "
                f"vm.max_map_count is {limit} and a compile may add {self.margin}; raise it "
                f"(sysctl -w vm.max_map_count=262144) or compile fewer programs (a smaller "
                f"--precompile-max-len, --max-num-seqs or --max-model-len)"
            )
        return usage

    def record(self, before: tuple[int, int] | None) -> None:
        """Learns the mappings the compile since check() added."""
        after = self._usage() if before is not None else None
        if after is not None:
            self.largest_increase = max(self.largest_increase, after[0] - before[0])
