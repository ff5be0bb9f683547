"""The printed tables: one run's (``format_table``) and several result files' as markdown (``--summary``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(row: dict[str, Any], key: str, digits: int = 3) -> str:
    return f"{row[key]:.{digits}f}" if key in row else "-"


def _overhead(row: dict[str, Any]) -> str:
    """lightning_pipe's engine overhead per microbatch and its share of stage compute ("" for others)."""
    if "engine" not in row:
        return ""
    e = row["engine"]
    return f"{e['overhead_ms_per_microbatch']:.2f} ms ({e['overhead_share_of_compute']:.1%})"


def format_table(results: dict[str, Any]) -> str:
    cfg = results["config"]
    lines = [
        f"{cfg['workload']}, {cfg['stages']} stages, {cfg['microbatches']} microbatches, {cfg['schedule']}, "
        f"batch {cfg['batch']}, {cfg['threads']} thread(s) per stage, torch {cfg['torch']}",
    ]
    if results["stage_fwd_bwd_ms"]:
        lines.append(
            "stage forward+backward per microbatch, ms (median / best): "
            + ", ".join(
                f"{m:.2f}/{b:.2f}"
                for m, b in zip(results["stage_fwd_bwd_ms"], results["stage_fwd_bwd_ms_best"], strict=True)
            )
            + f"; bound (M+S-1)*t_max: {results['bound_samples_per_s']:.1f} / {results['bound_samples_per_s_best']:.1f}"
            " samples/s"
        )
    cells = [
        ("contender", 20),
        ("samples/s median [min, max]", 28),
        ("vs torch (paired)", 17),
        ("vs torch (best)", 15),
        ("eff. vs bound (median/best)", 27),
        ("CPU ms/step user+sys", 20),
        ("peak RSS MB/process", 20),
        ("engine overhead/mb", 20),
        ("params", 8),
    ]
    lines.append("| " + " | ".join(f"{name:<{width}}" for name, width in cells) + " |")
    lines.append("|" + "|".join("-" * (width + 2) for _, width in cells) + "|")
    for name, row in results["contenders"].items():
        rate, overhead = row["samples_per_s"], _overhead(row)
        same = "same" if row["params_match"]["same"] else f"DIFF {row['params_match']['relative']:.1e}"
        values = [
            name,
            f"{rate['median']:.1f} [{rate['min']:.1f}, {rate['max']:.1f}]",
            _fmt(row, "ratio_vs_torch_paired"),
            _fmt(row, "ratio_vs_torch_best"),
            f"{_fmt(row, 'efficiency_vs_bound')} / {_fmt(row, 'efficiency_vs_bound_best')}",
            f"{row['cpu_ms_per_step']['user']:.0f} + {row['cpu_ms_per_step']['system']:.0f}",
            " + ".join(f"{x:.0f}" for x in row["peak_rss_mb"]),
            overhead,
            same,
        ]
        lines.append("| " + " | ".join(f"{v:<{width}}" for v, (_, width) in zip(values, cells, strict=True)) + " |")
    for name, row in results["contenders"].items():
        if "engine" in row:
            e = row["engine"]
            lines.append(
                f"{name}: measured bubble {e['bubble']:.3f} (idle {e['idle']:.3f}), "
                f"theoretical {e['theoretical_bubble']:.3f}"
            )
            if "wire_kb_per_step" in e:
                lines.append(
                    f"{name}: {e['wire_kb_per_step']:.1f} KB per step on the wire for {e['tensor_kb_per_step']:.1f} KB "
                    f"of tensors ({e['wire_kb_per_step'] / e['tensor_kb_per_step']:.0%}, compress={cfg['compress']}), "
                    f"compression {e['codec_ms_per_step']:.2f} ms of CPU per step, step {row['step_ms_median']:.1f} ms "
                    "median"
                )
    return "\n".join(lines)


def summary_table(paths: list[str]) -> str:
    """One markdown table of several result files (``--summary``): the columns docs/performance.md quotes."""
    lines = [
        "| workload | stages | contender | samples/s median [min, max] | vs torch (paired) | vs torch (medians) |"
        " eff. vs bound | peak RSS MB/process | engine overhead/mb |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path in paths:
        results = json.loads(Path(path).read_text())
        cfg = results["config"]
        for name, row in results["contenders"].items():
            rate, overhead = row["samples_per_s"], _overhead(row)
            cells = [
                cfg["workload"],
                str(cfg["stages"]),
                name,
                f"{rate['median']:.1f} [{rate['min']:.1f}, {rate['max']:.1f}]",
                _fmt(row, "ratio_vs_torch_paired", 2),
                _fmt(row, "ratio_vs_torch", 2),
                _fmt(row, "efficiency_vs_bound", 2),
                " + ".join(f"{x:.0f}" for x in row["peak_rss_mb"]),
                overhead,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
