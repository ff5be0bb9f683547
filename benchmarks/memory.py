"""Peak memory of every process: a plain Trainer, Lightning DDP and PipeStrategy in several layouts, side by side.

    python benchmarks/memory.py                      # the 512 MiB model of docs/big-models.md (32 x Linear(2048, 2048))
    python benchmarks/memory.py --width 1024 --depth 16 --json out/memory.json
    python benchmarks/memory.py --only "FSDP"        # the rows whose name holds FSDP (and their references)

Each configuration is a run of ``examples/big_model.py`` (Lightning's launcher starts its processes), most of them
resumed from the plain Trainer's checkpoint and trained 2 more steps; each process reports its peak resident
memory (``VmHWM``; on CUDA ``torch.cuda.max_memory_allocated``). The table gives it minus an empty process's
(torch, Lightning and lightning_pipe imported), in MiB and as a share of what the row measures against: the
model's training state (parameters, gradients and SGD momentum), or, for a build without a step, its
parameters; beside the ideal: that / (replicas x stages). The losses column checks that every run trains as
its reference does (the plain run, or a plain run from the same weights).

Rows take their start from an input (`Row.start`): ``plain`` (the plain Trainer's checkpoint, one file),
``sharded`` (the same state as a sharded folder, written by a 1 x 4 run that resumes it and trains nothing),
``weights`` (the plain checkpoint's module state as safetensors, ``PipeStrategy(weights=...)``) or ``seed``
(nothing: each stage initialised from the run's seed). Another mode's row (rpc's meta build) is one more `Row`.

The 3-D rows run ``examples/llama_3d.py`` instead (its ``small`` Llama-style model, 105 MiB of parameters, AdamW:
a training state of 4 x the parameters; 2 replicas x 2 stages x 2 tensor ranks, from the run's seed, 2 steps), DDP
or FSDP over each stage's replicas (``--data-parallel ddp`` / ``fsdp``: the module calls no ``fully_shard``; by
default it does, Lightning's recipe, which shards as ``fsdp`` does); their JSON also gives what each process holds
after the last step, counted: its share of the parameters (``held_parameter_share``), of their gradients
(``held_gradient_share``), its optimizer state as a share of the parameters (``held_optimizer_share``; AdamW's two
moments: 2 x the parameter share) and of the whole training state (``held_state_share``: all three over 4 x the
parameters; 1/(S x T) with DDP per stage, 1/(R x S x T) with FSDP).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "big_model.py"
LLAMA = ROOT / "examples" / "llama_3d.py"  # the 3-D rows' model (tensor parallel), with its own sizes
LLAMA_2X2X2 = ["--size", "small", "--devices", "8", "--stages", "2", "--tensor-parallel", "2", "--max-steps", "2"]
META_2X2 = ["--build", "meta", "--stages", "2", "--batch", "8"]  # 2 replicas of 8 rows: the plain run's 16 a step


@dataclass(frozen=True)
class Row:
    """One configuration: ``args`` of big_model.py, its ``processes``, its input (``start``), what its peak is a
    share of (``of``: ``"state"`` or ``"parameters"``) and the run whose losses it must take (``reference``:
    ``"plain"``, ``"plain from weights"``, or None for a run without a step)."""

    name: str
    args: list[str]
    processes: int
    start: str = "plain"
    of: str = "state"
    reference: str | None = "plain"
    piped: bool = True
    script: Path = EXAMPLE


ROWS: list[Row] = [
    Row("plain Trainer", ["--plain"], 1, piped=False),
    Row("Lightning DDP, 2 processes", ["--ddp", "--devices", "2", "--batch", "8"], 2, piped=False),
    Row("PipeStrategy 1 x 4, built in __init__", ["--build", "eager"], 4),
    Row("PipeStrategy 1 x 4, init_module(empty_init=True)", ["--build", "meta"], 4),
    Row("PipeStrategy 1 x 4, configure_model", ["--build", "configure_model"], 4),
    Row("PipeStrategy 1 x 4, meta, resumed from a sharded folder", ["--build", "meta"], 4, start="sharded"),
    Row("PipeStrategy 1 x 4, meta, weights= (safetensors)", ["--build", "meta"], 4, start="weights",
        reference="plain from weights"),
    Row("PipeStrategy local mode, 4 stages in 1 process, meta", ["--build", "meta", "--devices", "1"], 1),
    Row("PipeStrategy 2 x 2, DDP per stage", META_2X2, 4),
    Row("PipeStrategy 2 x 2, FSDP per stage", [*META_2X2, "--data-parallel", "fsdp"], 4),
    Row("PipeStrategy 2 x 2 FSDP from seeded init, peak before step 1",
        [*META_2X2, "--data-parallel", "fsdp", "--epochs", "0"], 4, start="seed", of="parameters", reference=None),
    Row("PipeStrategy 2 x 2 x 2 (tensor parallel), DDP per stage, built in __init__",
        [*LLAMA_2X2X2, "--data-parallel", "ddp"], 8, start="seed", reference="llama plain", script=LLAMA),
    Row("PipeStrategy 2 x 2 x 2 (tensor parallel), DDP per stage, meta",
        [*LLAMA_2X2X2, "--data-parallel", "ddp", "--build", "meta"], 8, start="seed", reference=None, script=LLAMA),
    Row("PipeStrategy 2 x 2 x 2 (tensor parallel), FSDP per stage, built in __init__",
        [*LLAMA_2X2X2, "--data-parallel", "fsdp"], 8, start="seed", reference="llama plain", script=LLAMA),
    Row("PipeStrategy 2 x 2 x 2 (tensor parallel), FSDP per stage, meta",
        [*LLAMA_2X2X2, "--data-parallel", "fsdp", "--build", "meta"], 8, start="seed", reference=None, script=LLAMA),
    Row("PipeStrategy 2 x 2 (the 3-D rows' model without tensor parallel), DDP per stage, meta",
        [*LLAMA_2X2X2, "--devices", "4", "--tensor-parallel", "1", "--build", "meta"], 4, start="seed", reference=None,
        script=LLAMA),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: list[str], timeout: float, script: Path = EXAMPLE) -> None:
    """``python examples/big_model.py ...`` (or another ``script``) in a session of its own, ended with all its
    processes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen([sys.executable, str(script), *args], env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out[-4000:]}")


def reports(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--accelerator", default="cpu", help="gpu: one process per GPU, CUDA memory reported too")
    parser.add_argument("--only", default=None, help="a regular expression: run only the rows whose name matches")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "memory.json"))
    args = parser.parse_args()
    model = ["--width", str(args.width), "--depth", str(args.depth), "--accelerator", args.accelerator]
    parameters = args.depth * (args.width * args.width + args.width) * 4 / 2**20  # MiB
    sizes = {"state": 3 * parameters, "parameters": parameters}  # training state: params + grads + momentum
    chosen = [row for row in ROWS if args.only is None or re.search(args.only, row.name)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Inputs(Path(tmp), model, args.timeout)
        empty = inputs.empty()
        for row in chosen:
            folder = inputs.out / f"run{len(rows)}"
            config = [*row.args, *inputs.start(row.start)]
            own = model if row.script == EXAMPLE else ["--accelerator", args.accelerator]
            run([*own, *config, "--report", str(folder)], args.timeout, row.script)
            got = reports(folder)
            of = sizes_of(got, sizes)[row.of]
            losses = [r["losses"] for r in got if r["losses"]]
            inputs.ran[tuple(config)] = losses  # a row that is a reference run (the plain one) is not run twice
            reference = inputs.reference(row.reference) if row.reference is not None else None
            rows.append({
                "config": row.name,
                "start": row.start,
                "of": row.of,
                "peak_mib": [round(r["peak_mib"] - empty) for r in got],
                "share": [round((r["peak_mib"] - empty) / of, 3) for r in got],
                "ideal_mib": round(of / row.processes if row.piped else of),  # / (R x S)
                "cuda_peak_mib": [r.get("cuda_peak_mib") for r in got],
                "losses": losses,
                "reference_losses": reference,
                "losses_equal": None if reference is None else same_losses(losses, reference),
                "of_mib": round(of),
                **held_shares(got),
            })  # fmt: skip
    print_table(rows, sizes, empty)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    document = {"state_mib": sizes["state"], "parameters_mib": parameters, "empty_mib": empty, "rows": rows}
    Path(args.json).write_text(json.dumps(document, indent=1))


class Inputs:
    """What the rows start from, made once when a row first needs it, in ``out``; and the references' losses."""

    def __init__(self, out: Path, model: list[str], timeout: float) -> None:
        self.out, self.model, self.timeout = out, model, timeout
        self._made: dict[str, Any] = {}
        self.ran: dict[tuple[str, ...], list[list[float]]] = {}  # each row's losses, by its arguments

    def _once(self, name: str, make: Any) -> Any:
        if name not in self._made:
            self._made[name] = make()
        return self._made[name]

    def empty(self) -> float:
        run(["--empty", "--report", str(self.out / "empty")], self.timeout)
        return float(reports(self.out / "empty")[0]["peak_mib"])

    def plain(self) -> Path:
        """The plain Trainer's checkpoint after one step (one file)."""

        def make() -> Path:
            path = self.out / "plain.ckpt"
            run([*self.model, "--plain", "--epochs", "1", "--save", str(path)], self.timeout)
            return path

        return self._once("plain", make)  # type: ignore[no-any-return]

    def start(self, start: str) -> list[str]:
        """big_model.py's arguments for a row that starts from ``start``."""
        if start == "seed":
            return []
        if start == "plain":
            return ["--ckpt-path", str(self.plain())]
        if start == "sharded":
            return ["--ckpt-path", str(self._once("sharded", self._sharded))]
        if start == "weights":
            return ["--weights", str(self._once("weights", self._weights)), "--epochs", "2"]
        raise ValueError(f"unknown start {start!r}: seed, plain, sharded or weights")

    def reference(self, name: str) -> list[float]:
        """The losses a row must take: the plain run resumed from its checkpoint, or a plain run from the weights."""
        if name == "llama plain":  # the 3-D rows' model in one plain process (no checkpoint: built from the seed)
            return self._once(name, self._llama_plain)  # type: ignore[no-any-return]
        if name == "plain":
            args = ["--ckpt-path", str(self.plain())]
        elif name == "plain from weights":
            args = ["--weights", str(self._once("weights", self._weights)), "--epochs", "2"]
        else:
            raise ValueError(f"unknown reference {name!r}: plain, plain from weights or llama plain")

        if ("--plain", *args) in self.ran:
            return self.ran[("--plain", *args)][0]

        def make() -> list[float]:
            folder = self.out / f"reference-{len(self._made)}"
            run([*self.model, "--plain", *args, "--report", str(folder)], self.timeout)
            return [float(x) for x in reports(folder)[0]["losses"]]

        return self._once(f"reference {name}", make)  # type: ignore[no-any-return]

    def _llama_plain(self) -> list[float]:
        folder = self.out / "llama-plain"
        run([*LLAMA_2X2X2, "--strategy", "plain", "--report", str(folder)], self.timeout, LLAMA)
        return [float(x) for x in reports(folder)[0]["losses"]]

    def _sharded(self) -> Path:
        """The plain checkpoint's state as a sharded folder: a 1 x 4 run resumes it, trains nothing and saves."""
        path = self.out / "sharded"
        run([*self.model, "--build", "meta", "--epochs", "1", "--ckpt-path", str(self.plain()),
             "--save-at-end", str(path)], self.timeout)  # fmt: skip
        return path

    def _weights(self) -> Path:
        """The plain checkpoint's pipelined module as safetensors (what ``save_pretrained`` writes)."""
        import torch
        from safetensors.torch import save_file

        state = torch.load(self.plain(), map_location="cpu", mmap=True, weights_only=True)["state_dict"]
        path = self.out / "weights.safetensors"
        save_file({k[len("model.") :]: v.contiguous() for k, v in state.items() if k.startswith("model.")}, path)
        return path


def sizes_of(got: list[dict[str, Any]], sizes: dict[str, float]) -> dict[str, float]:
    """The sizes a row's peaks are shares of: big_model.py's from ``--width``/``--depth``; llama_3d.py reports its
    parameters' bytes, and its AdamW makes the training state 4 x them (parameters, gradients, two moments)."""
    if "parameter_bytes" not in got[0]:
        return sizes
    parameters = got[0]["parameter_bytes"] / 2**20
    return {"state": 4 * parameters, "parameters": parameters}


def held_shares(got: list[dict[str, Any]]) -> dict[str, list[float]]:
    """What each process of a llama_3d.py row holds after its last step (none for big_model.py's rows): shares of
    the parameters' bytes, and of the training state's (the three over 4 x the parameters)."""
    if "parameter_bytes" not in got[0]:
        return {"held_parameter_share": []}
    keys = [f"held_{part}_bytes" for part in ("parameter", "gradient", "optimizer")]
    shares = {key[:-5] + "share": [round(r[key] / r["parameter_bytes"], 3) for r in got] for key in keys}
    state = [sum(r[key] for key in keys) / (4 * r["parameter_bytes"]) for r in got]
    return {**shares, "held_state_share": [round(share, 3) for share in state]}


def same_losses(losses: list[list[float]], reference: list[float]) -> bool:
    """Whether the replicas' mean loss of each step (each replica's is over its share of the rows) is the
    reference's, to 1e-5."""
    if not losses:
        return False
    mean = [sum(step) / len(step) for step in zip(*losses, strict=True)]
    pairs = zip(mean, reference, strict=True) if len(mean) == len(reference) else None
    return pairs is not None and all(abs(a - b) <= 1e-5 * abs(b) for a, b in pairs)


def print_table(rows: list[dict[str, Any]], sizes: dict[str, float], empty: float) -> None:
    print(f"training state {sizes['state']:.0f} MiB, parameters {sizes['parameters']:.0f} MiB; "
          f"an empty process {empty:.0f} MiB (subtracted)\n")  # fmt: skip
    cuda = any(v is not None for row in rows for v in row["cuda_peak_mib"])
    print(
        "| configuration | peak per process, MiB | share | of | ideal, MiB | losses = reference |"
        + (" CUDA, MiB |" if cuda else "")
    )
    print("| --- | --- | --- | --- | --- | --- |" + (" --- |" if cuda else ""))
    for row in rows:
        peaks = " / ".join(map(str, row["peak_mib"]))
        unchecked = "no reference" if row["losses"] else "no step"
        equal = {None: unchecked, True: "yes", False: "**no**"}[row["losses_equal"]]
        of = "training state" if row["of"] == "state" else "parameters"
        line = f"| {row['config']} | {peaks} | {max(row['share']):.2f} | {of} | {row['ideal_mib']} | {equal} |"
        if cuda:
            line += " " + " / ".join(f"{v:.0f}" for v in row["cuda_peak_mib"] if v is not None) + " |"
        print(line)
    for row in rows:
        if row.get("held_state_share"):
            held = ", ".join(f"{part} {max(row[f'held_{part}_share']):.3f}" for part in ("parameter", "gradient",
                             "optimizer", "state"))  # fmt: skip
            print(f"{row['config']}: held at most (shares of the parameters; state: of the training state) {held}")


if __name__ == "__main__":
    main()
