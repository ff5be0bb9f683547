"""The execution trace: per stage, which backend ran it and which substituted operations ran where."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OpKey = tuple[str, str, str]  # (op, implementation name, backend)


@dataclass
class OpCounter:
    """How often each op ran, by implementation and backend."""

    counts: dict[OpKey, int] = field(default_factory=dict)

    def add(self, op: str, impl: str, backend: str, n: int = 1) -> None:
        key = (op, impl, backend)
        self.counts[key] = self.counts.get(key, 0) + n

    def merge(self, other: OpCounter) -> None:
        for (op, impl, backend), n in other.counts.items():
            self.add(op, impl, backend, n)

    def count(self, op: str | None = None, impl: str | None = None, backend: str | None = None) -> int:
        """Calls matching every given field."""
        return sum(
            n
            for (o, i, b), n in self.counts.items()
            if (op is None or o == op) and (impl is None or i == impl) and (backend is None or b == backend)
        )


@dataclass
class StageTrace:
    """One stage's record: forward calls per mode and backend, op substitutions, declined backends."""

    stage: int
    runs: dict[str, dict[str, int]] = field(default_factory=dict)  # mode -> backend -> forward calls
    ops: dict[str, OpCounter] = field(default_factory=dict)  # mode -> op counts
    declined: dict[tuple[str, str], str] = field(default_factory=dict)  # (mode, backend) -> reason
    # mode -> kind ("forward", "backward", "backward_input", "backward_weight") -> graphs compiled
    graphs: dict[str, dict[str, int]] = field(default_factory=dict)
    unsplit: dict[str, str] = field(default_factory=dict)  # mode -> why its compiled backward is not split

    def count_run(self, mode: str, backend: str) -> None:
        per_mode = self.runs.setdefault(mode, {})
        per_mode[backend] = per_mode.get(backend, 0) + 1

    def reset(self) -> None:
        """Zero the counts; declined backends, compiled graphs and unsplit backwards stay (compiled once)."""
        self.runs.clear()
        for counter in self.ops.values():
            counter.counts.clear()  # compilers hold these counters: clear in place

    def merge(self, other: StageTrace) -> None:
        """Add ``other``'s counts and declines to this trace."""
        for mode, per_mode in other.runs.items():
            for backend, n in per_mode.items():
                mine = self.runs.setdefault(mode, {})
                mine[backend] = mine.get(backend, 0) + n
        for mode, counter in other.ops.items():
            self.op_counter(mode).merge(counter)
        self.declined.update(other.declined)
        for mode, kinds in other.graphs.items():
            mine = self.graphs.setdefault(mode, {})
            for kind, n in kinds.items():
                mine[kind] = mine.get(kind, 0) + n
        self.unsplit.update(other.unsplit)

    def op_counter(self, mode: str) -> OpCounter:
        return self.ops.setdefault(mode, OpCounter())

    def backend(self, mode: str) -> str | None:
        """The backend that ran most of this stage's forwards in ``mode`` (None if it never ran)."""
        per_mode = self.runs.get(mode)
        return max(per_mode, key=per_mode.__getitem__) if per_mode else None

    def count(self, mode: str | None = None, **match: str) -> int:
        return sum(c.count(**match) for m, c in self.ops.items() if mode is None or m == mode)

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "runs": self.runs,
            "ops": [
                {"mode": mode, "op": op, "impl": impl, "backend": backend, "count": n}
                for mode, counter in self.ops.items()
                for (op, impl, backend), n in counter.counts.items()
            ],
            "declined": [{"mode": m, "backend": b, "reason": r} for (m, b), r in self.declined.items()],
            "graphs": self.graphs,
            "unsplit": self.unsplit,
        }


@dataclass
class ExecutionTrace:
    """The whole pipeline's trace; ``print(trace)`` draws a table."""

    stages: list[StageTrace]

    def __getitem__(self, stage: int) -> StageTrace:
        return next(s for s in self.stages if s.stage == stage)

    def merged(self, other: ExecutionTrace) -> ExecutionTrace:
        """A new trace with the counts of both (e.g. a fit's and a later validate's pipelines)."""
        stages: dict[int, StageTrace] = {}
        for trace in (*self.stages, *other.stages):
            stages.setdefault(trace.stage, StageTrace(trace.stage)).merge(trace)
        return ExecutionTrace([stages[i] for i in sorted(stages)])

    def count(self, stage: int | None = None, mode: str | None = None, **match: str) -> int:
        """Op calls matching ``op=``, ``impl=``, ``backend=`` over one stage or all of them."""
        return sum(s.count(mode, **match) for s in self.stages if stage is None or s.stage == stage)

    def as_dict(self) -> dict[str, Any]:
        return {"stages": [s.as_dict() for s in self.stages]}

    def __str__(self) -> str:
        lines = []
        for s in self.stages:
            runs = "; ".join(
                f"{mode}: " + ", ".join(f"{b} x{n}" for b, n in per_mode.items()) for mode, per_mode in s.runs.items()
            )
            lines.append(f"stage {s.stage}  {runs or 'not run yet'}")
            for mode, counter in s.ops.items():
                for (op, impl, backend), n in sorted(counter.counts.items()):
                    where = impl if impl == backend else f"{impl} [{backend}]"
                    lines.append(f"  {mode:<5}  {op:<40} -> {where} x{n}")
            for (mode, backend), reason in s.declined.items():
                lines.append(f"  {mode:<5}  {backend} declined: {reason}")
            for mode, kinds in s.graphs.items():
                lines.append(f"  {mode:<5}  compiled graphs: " + ", ".join(f"{k} x{n}" for k, n in kinds.items()))
            for mode, reason in s.unsplit.items():
                lines.append(f"  {mode:<5}  backward not split into I and W: {reason}")
        return "\n".join(lines)
