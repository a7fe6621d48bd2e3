"""Merge the two sides of a benchmark run into a table and into benchmarks/RESULTS.md.

    python -m benchmarks.compare ours.json [reference.json] [--results benchmarks/RESULTS.md]

Per case and mode: time of ours and of the reference (ms, do_bench median), the ratio
ours / reference (below 1: ours is faster), achieved TFLOP/s and GB/s (and the share of
the measured copy bandwidth), peak memory above the inputs, and the cold start of each.
The plain table is printed last on stdout. With ``--results``, the part of that file
between ``<!-- generated:start -->`` and ``<!-- generated:end -->`` is replaced (added at
the end when absent); everything outside the markers is kept as written.

Standard library only: it runs anywhere, without torch or a GPU.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path

START = "<!-- generated:start -->"
END = "<!-- generated:end -->"
MODES = ("fwd", "fwdbwd")
MODE_LABEL = {"fwd": "fwd", "fwdbwd": "fwd+bwd"}
REF_PATCH_NOTE = "reference bwd check patched out, results untrusted"

DEFAULT_PREAMBLE = """# Benchmark results

Side-by-side timings of `fla` (this repository) and the reference library
flash-linear-attention, measured in one run on the same GPU, each library in its own
process. Regenerate on the GPU machine with `bash scripts/gpu_run.sh` (it writes
`$OUT/RESULTS.md`), or from two JSON files with
`python -m benchmarks.compare ours.json reference.json --results benchmarks/RESULTS.md`.
Only the part between the `generated` markers is rewritten.
"""


# ---------------------------------------------------------------------------------------
# Loading and merging

def load(path: str | Path | None) -> dict | None:
    """A run_side JSON file, or None when the path is missing/empty/unreadable."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        print(f"compare: {p} not found: that side is left empty", file=sys.stderr)
        return None
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        print(f"compare: cannot read {p}: {exc}", file=sys.stderr)
        return None
    if not isinstance(data, dict) or not isinstance(data.get("cases"), dict):
        print(f"compare: {p} is not a run_side result", file=sys.stderr)
        return None
    return data


def rates(ms: float | None, work: dict | None, copy_gbps: float | None) -> dict:
    """TFLOP/s, GB/s, share of copy bandwidth (and state GB/s) for one timing."""
    out: dict[str, float] = {}
    if not ms or ms <= 0 or not work:
        return out
    if work.get("flops"):
        out["tflops"] = work["flops"] / ms / 1e9
    if work.get("bytes"):
        out["gbps"] = work["bytes"] / ms / 1e6
        if copy_gbps:
            out["pct_copy"] = 100.0 * out["gbps"] / copy_gbps
    if work.get("state_bytes"):
        out["state_gbps"] = work["state_bytes"] / ms / 1e6
        if copy_gbps:
            out["state_pct_copy"] = 100.0 * out["state_gbps"] / copy_gbps
    return out


def _side(data: dict | None, name: str, mode: str) -> dict:
    """What one side knows of (case, mode): status, ms, memory, cold, rates, notes."""
    if data is None:
        return {"status": "absent"}
    case = data["cases"].get(name)
    if case is None:
        return {"status": "not run"}
    entry = (case.get("modes") or {}).get(mode)
    if entry is None:
        status = case.get("status", "unknown")
        if status == "ok":  # the case has no such mode
            status = "n/a"
        return {"status": status, "error": case.get("error"), "notes": case.get("notes", []),
                "cold_s": None}
    ms = entry.get("ms")
    return {
        "status": entry.get("status", "unknown") if ms is None else "ok",
        "ms": ms,
        "error": entry.get("error") or case.get("error"),
        "extra_mem_bytes": entry.get("extra_mem_bytes"),
        "peak_mem_bytes": entry.get("peak_mem_bytes"),
        "cold_s": case.get("cold_s"),
        "cold_mode": case.get("cold_mode"),
        "notes": case.get("notes", []),
        "work": entry.get("work") or {},
        "rates": rates(ms, entry.get("work"), data.get("copy_gbps")),
    }


def _case_order(ours: dict | None, ref: dict | None) -> list[tuple[str, dict]]:
    """Cases in run order (ours first, then reference-only ones); each baseline right
    after the case it gives context to, when that case is in the run."""
    seen: dict[str, dict] = {}
    for data in (ours, ref):
        for name, case in (data or {}).get("cases", {}).items():
            seen.setdefault(name, case)
    names = list(seen)
    ordered = [n for n in names if not seen[n].get("baseline_for")
               or seen[n]["baseline_for"] not in seen]
    for name in names:
        parent = seen[name].get("baseline_for")
        if parent and parent in seen:
            at = ordered.index(parent) + 1
            while at < len(ordered) and seen[ordered[at]].get("baseline_for") == parent:
                at += 1
            ordered.insert(at, name)
    return [(n, seen[n]) for n in ordered]


def merge(ours: dict | None, ref: dict | None) -> list[dict]:
    """One row per (case, mode) present on either side."""
    rows = []
    for name, meta in _case_order(ours, ref):
        modes = set()
        for data in (ours, ref):
            case = (data or {}).get("cases", {}).get(name) or {}
            modes.update((case.get("modes") or {}).keys())
        for mode in [m for m in MODES if m in modes] or ["fwd"]:
            o, r = _side(ours, name, mode), _side(ref, name, mode)
            ratio = (o["ms"] / r["ms"]) if o.get("ms") and r.get("ms") else None
            mem_ratio = (o["extra_mem_bytes"] / r["extra_mem_bytes"]
                         if o.get("extra_mem_bytes") and r.get("extra_mem_bytes") else None)
            rows.append({
                "case": name, "op": meta.get("op", name.split("/")[0]),
                "shape": "x".join(str(s) for s in meta.get("shape", [])),
                "dims": meta.get("dims", ""), "mode": mode,
                "baseline": bool(meta.get("baseline")), "ours": o, "ref": r,
                "ratio": ratio, "mem_ratio": mem_ratio,
                "notes": _row_notes(mode, o, r, meta),
            })
    return rows


def _short(text: str | None, limit: int = 90) -> str:
    if not text:
        return ""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _row_notes(mode: str, o: dict, r: dict, meta: dict) -> list[str]:
    notes: list[str] = []
    if meta.get("note"):
        notes.append(meta["note"])
    if meta.get("baseline"):
        notes.append("plain PyTorch (timed in the ours process)")
    for tag, side in (("ours", o), ("ref", r)):
        for note in side.get("notes") or []:
            if note.startswith(REF_PATCH_NOTE):
                if mode == "fwdbwd":
                    notes.append("ref bwd check patched out: untrusted")
            else:
                notes.append(f"{tag}: {_short(note, 80)}")
        if side.get("status") not in ("ok", "absent", "not run", "n/a", "skipped") \
                and side.get("error"):
            notes.append(f"{tag} {side['status']}: {_short(side['error'])}")
    seen: set[str] = set()
    return [n for n in notes if not (n in seen or seen.add(n))]


# ---------------------------------------------------------------------------------------
# Formatting

def fmt_ms(side: dict) -> str:
    ms = side.get("ms")
    if ms is None:
        return {"absent": "—", "not run": "—", "n/a": "—", "skipped": "—"}.get(
            side.get("status"), side.get("status", "—"))
    return f"{ms:.3f}" if ms < 100 else f"{ms:.1f}"


def fmt_ratio(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}×"


def fmt_mib(nbytes: float | None) -> str:
    return "—" if nbytes is None else f"{nbytes / 2 ** 20:.0f}"


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds:.1f}" if seconds < 100 else f"{seconds:.0f}"


def _bw(gbps: float) -> str:
    return f"{gbps / 1000:.2f} TB/s" if gbps >= 1000 else f"{gbps:.0f} GB/s"


def fmt_rate(side: dict) -> str:
    r = side.get("rates") or {}
    parts = []
    if "tflops" in r:
        parts.append(f"{r['tflops']:.1f} TFLOP/s")
    if "gbps" in r:
        parts.append(_bw(r["gbps"]) + (f" ({r['pct_copy']:.0f}% copy)" if "pct_copy" in r else ""))
    if "state_gbps" in r:
        parts.append("state " + _bw(r["state_gbps"])
                     + (f" ({r['state_pct_copy']:.0f}% copy)" if "state_pct_copy" in r else ""))
    return ", ".join(parts) if parts else "—"


def _pair(a: str, b: str) -> str:
    return f"{a} / {b}"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(rows: list[dict]) -> str:
    head = ("| case | shape | mode | ours ms | ref ms | ours/ref | ours rate | ref rate "
            "| mem MiB ours / ref | cold s ours / ref | notes |")
    sep = "|" + "---|" * 11
    lines = [head, sep]
    for row in rows:
        o, r = row["ours"], row["ref"]
        name = row["op"] + (" (PyTorch)" if row["baseline"] else "")
        cells = [name, row["shape"], MODE_LABEL.get(row["mode"], row["mode"]), fmt_ms(o),
                 fmt_ms(r), fmt_ratio(row["ratio"]), fmt_rate(o), fmt_rate(r),
                 _pair(fmt_mib(o.get("extra_mem_bytes")), fmt_mib(r.get("extra_mem_bytes"))),
                 _pair(fmt_s(o.get("cold_s")), fmt_s(r.get("cold_s"))),
                 "; ".join(row["notes"])]
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    return "\n".join(lines)


def plain_table(rows: list[dict]) -> str:
    head = ["case", "mode", "ours ms", "ref ms", "ours/ref", "mem MiB o/r", "cold s o/r",
            "rate (ours)"]
    body = []
    for row in rows:
        o, r = row["ours"], row["ref"]
        body.append([row["case"] + (" (torch)" if row["baseline"] else ""),
                     MODE_LABEL.get(row["mode"], row["mode"]), fmt_ms(o), fmt_ms(r),
                     fmt_ratio(row["ratio"]),
                     _pair(fmt_mib(o.get("extra_mem_bytes")), fmt_mib(r.get("extra_mem_bytes"))),
                     _pair(fmt_s(o.get("cold_s")), fmt_s(r.get("cold_s"))), fmt_rate(o)])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]

    def fmt(cells: list) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def _env(data: dict | None) -> dict:
    return (data or {}).get("env") or {}


def header_lines(ours: dict | None, ref: dict | None, when: str | None = None) -> list[str]:
    eo, er = _env(ours), _env(ref)
    env = eo or er
    when = when or (ours or ref or {}).get("finished") or (ours or ref or {}).get("started") \
        or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    lines = [f"## Latest side-by-side run ({when[:10]})", ""]
    device = env.get("device", "unknown device")
    if env.get("sm_count"):
        device += f", {env['sm_count']} SMs"
    lines.append(f"- Measured: {when}, on {device}.")
    versions = []
    for key, label in (("torch", "torch"), ("triton", "Triton"), ("cuda", "CUDA")):
        vo, vr = eo.get(key), er.get(key)
        if vo and vr and vo != vr:
            versions.append(f"{label} {vo} (ours) / {vr} (reference)")
        elif vo or vr:
            versions.append(f"{label} {vo or vr}")
    lines.append("- Versions: " + ", ".join(versions) + ".")
    ours_v = eo.get("fla_version") or "?"
    if ref is None:
        lines.append(f"- Ours: fla {ours_v}. Reference: not run in this measurement.")
    elif er.get("fla_import_error"):
        lines.append(f"- Ours: fla {ours_v}. Reference: import failed: "
                     f"{_short(er['fla_import_error'], 200)}")
    else:
        lines.append(f"- Ours: fla {ours_v}. Reference: flash-linear-attention "
                     f"{er.get('fla_version') or '?'}, in its own process.")
    copies = []
    for tag, data in (("ours run", ours), ("reference run", ref)):
        if data and data.get("copy_gbps"):
            copies.append(f"{tag} {_bw(data['copy_gbps'])}")
    if copies:
        lines.append("- Measured copy bandwidth (1 GiB device-to-device, read + write): "
                     + ", ".join(copies) + "; `% copy` is relative to the same run's figure.")
    settings = (ours or ref or {}).get("settings") or {}
    quick = " (quick mode)" if settings.get("quick") else ""
    lines.append(f"- Timing: `triton.testing.do_bench` median (warmup "
                 f"{settings.get('warmup_ms', '?')} ms, rep {settings.get('rep_ms', '?')} ms)"
                 f"{quick}, bf16 inputs; fwd under `torch.no_grad()`; fwd+bwd backpropagates "
                 f"a fixed random grad_output into every input. ours/ref below 1: ours faster.")
    lines.append("- mem: peak `torch.cuda.max_memory_allocated` during one call, above what "
                 "was allocated before it (inputs excluded), MiB.")
    fresh = [f"{tag} {'empty' if d.get('triton_cache_empty_at_start') else 'warm'}"
             for tag, d in (("ours", eo), ("reference", er))
             if "triton_cache_empty_at_start" in d]
    lines.append("- cold: wall clock of the first call at that shape in the process (fwd+bwd "
                 "where the case has a backward), compile and autotuning included"
                 + (f"; Triton cache at start: {', '.join(fresh)}" if fresh else "") + ".")
    lines.append("- Rates: FLOPs and bytes as counted in `benchmarks/cases.py` (the same "
                 "counts for both libraries).")
    notes = []
    for tag, data in (("ours", ours), ("reference", ref)):
        for note in (data or {}).get("notes") or []:
            notes.append(f"{tag}: {note}")
    if notes:
        lines.append("- Notes: " + "; ".join(_short(n, 300) for n in notes) + ".")
    if settings.get("tiny"):
        lines.append("- WARNING: --tiny run (shrunken shapes): a smoke test, not a measurement.")
    return lines


def generated_block(ours: dict | None, ref: dict | None, rows: list[dict],
                    when: str | None = None) -> str:
    parts = [START, *header_lines(ours, ref, when), ""]
    parts.append(markdown_table(rows) if rows else "No case was measured.")
    parts.append(END)
    return "\n".join(parts) + "\n"


def update_results(path: str | Path, block: str) -> str:
    """Replace the generated block of ``path`` (append it when absent); keep the rest."""
    p = Path(path)
    text = p.read_text() if p.is_file() else DEFAULT_PREAMBLE
    start, end = text.find(START), text.find(END)
    if start != -1 and end != -1 and end > start:
        new = text[:start] + block.rstrip("\n") + text[end + len(END):]
    else:
        new = text.rstrip("\n") + "\n\n" + block
    if not new.endswith("\n"):
        new += "\n"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(new)
    return new


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ours", help="run_side JSON of ours")
    ap.add_argument("reference", nargs="?", default=None, help="run_side JSON of the reference")
    ap.add_argument("--results", default=None,
                    help="markdown file whose generated block is rewritten "
                         "(e.g. benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    ours, ref = load(args.ours), load(args.reference)
    if ours is None and ref is None:
        print("compare: nothing to compare", file=sys.stderr)
        return 1
    rows = merge(ours, ref)
    if args.results:
        update_results(args.results, generated_block(ours, ref, rows))
        print(f"compare: wrote {args.results}", file=sys.stderr)
    sys.stderr.flush()
    env = _env(ours) or _env(ref)
    print(f"{env.get('device', '?')} | torch {env.get('torch', '?')} | Triton "
          f"{env.get('triton', '?')} | reference {_env(ref).get('fla_version', 'not run')}")
    print(plain_table(rows) if rows else "(no cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
