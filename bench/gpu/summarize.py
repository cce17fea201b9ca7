"""Ratios of the GPU benchmark (bench/gpu/run.sh) from its bench.jsonl, into summary.json.

For each (model, batch) of one-worker runs: flotilla's best mixed_bfloat16 samples/s (CUDA graph
on or off, either memory format) against PyTorch eager with bf16 autocast at its best memory
format (NCHW or channels_last; goal >= 1.1) and against torch.compile with bf16 autocast, in its
default mode and with CUDA graphs (mode="reduce-overhead"; goal >= 1.0 each); the same ratios for float32 and mixed_float16 as information; what the CUDA graph
changes (graph on / off, flotilla's default memory format) and what channels-last changes for
each side (channels_last / NCHW) for each precision. Several lines for one configuration
(reruns) count by their median; each optimizer (sgd, adam...) has rows of its own. Two-process lines (workers 2) are listed with their scaling
against the same configuration on one worker. Error lines are counted and listed, never used.

Usage: python3 summarize.py BENCH_JSONL [SUMMARY_JSON]   (prints the summary to stdout too)
Needs only the standard library: the GPU machine's python3 runs it.
"""
import json
import statistics
import sys

GOALS = {"torch-eager": 1.1, "torch-compile": 1.0, "torch-compile-graphs": 1.0}


def load(path):
    lines, bad = [], 0
    with open(path) as f:
        for raw in f:
            raw = raw.strip()
            if not raw.startswith("{"):
                continue
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                bad += 1  # a line cut by a timeout
    return lines, bad


def median_rate(lines):
    rates = [l["samples_per_s"] for l in lines]
    return statistics.median(rates) if rates else None


def pick(results, **want):
    return [r for r in results if all(r.get(k) == v for k, v in want.items())]


def best_rate(lines):
    """The median of the fastest memory format's lines (a peer at its best)."""
    formats = {l.get("memory_format", "nchw") for l in lines}
    rates = [median_rate([l for l in lines if l.get("memory_format", "nchw") == f])
             for f in formats]
    return max([r for r in rates if r], default=None)


def ratio(a, b):
    return round(a / b, 3) if a and b else None


def summarize(lines):
    errors = [l for l in lines if "error" in l or "samples_per_s" not in l]
    results = [l for l in lines if l not in errors and l.get("bench") == "gpu_train"]
    single = [r for r in results if r.get("workers", 1) == 1]
    rows = []
    for model, batch, opt in sorted({(r["model"], r["batch"], r.get("optimizer", "sgd"))
                                     for r in single}):
        here = [r for r in pick(single, model=model, batch=batch)
                if r.get("optimizer", "sgd") == opt]
        row = {"model": model, "batch": batch, "optimizer": opt, "samples_per_s": {}, "ratios": {},
               "cuda_graph_speedup": {}, "channels_last_speedup": {}}
        for precision in ("float32", "mixed_bfloat16", "mixed_float16"):
            flotilla = pick(here, impl="flotilla", precision=precision)
            nchw_lines = [r for r in flotilla if r.get("memory_format") == "nchw"]
            nchw = median_rate([r for r in nchw_lines if not r.get("cuda_graph")])
            nchw_graph = median_rate([r for r in nchw_lines if r.get("cuda_graph")])
            default = [r for r in flotilla if r.get("memory_format") != "nchw"] or flotilla
            graph_off = median_rate([r for r in default if not r.get("cuda_graph")])
            graph_on = median_rate([r for r in default if r.get("cuda_graph")])
            best = max([r for r in (graph_off, graph_on, nchw, nchw_graph) if r], default=None)
            rates = {"flotilla": graph_off, "flotilla+cuda_graph": graph_on,
                     "flotilla nchw": nchw, "flotilla nchw+cuda_graph": nchw_graph}
            for peer in GOALS:
                rates[peer] = best_rate(pick(here, impl=peer, precision=precision))
                key = f"flotilla_best/{peer}"
                row["ratios"].setdefault(precision, {})[key] = ratio(best, rates[peer])
            eager = pick(here, impl="torch-eager", precision=precision)
            row["channels_last_speedup"][precision] = {
                "flotilla": ratio(graph_off, nchw) if nchw and default is not flotilla else None,
                "flotilla+cuda_graph": (ratio(graph_on, nchw_graph)
                                        if nchw_graph and default is not flotilla else None),
                "torch-eager": ratio(
                    median_rate([r for r in eager if r.get("memory_format") == "channels_last"]),
                    median_rate([r for r in eager if r.get("memory_format", "nchw") == "nchw"]))}
            row["samples_per_s"][precision] = {k: round(v, 1) if v else None
                                               for k, v in rates.items()}
            row["cuda_graph_speedup"][precision] = ratio(graph_on, graph_off)
        row["goals"] = {}
        for peer, goal in GOALS.items():
            value = row["ratios"]["mixed_bfloat16"][f"flotilla_best/{peer}"]
            row["goals"][f"bf16 vs {peer} >= {goal}"] = (
                None if value is None else value >= goal)
        rows.append(row)

    two = []
    for r in [r for r in results if r.get("workers", 1) > 1]:
        alone = median_rate(pick(single, impl=r["impl"], model=r["model"], batch=r["batch"],
                                 precision=r["precision"], cuda_graph=r.get("cuda_graph", False)))
        two.append({k: r.get(k) for k in ("impl", "model", "batch", "precision", "cuda_graph",
                                           "workers", "implementation", "samples_per_s",
                                           "step_ms")}
                   | {"scaling_vs_one_worker": ratio(r["samples_per_s"], alone)})
    two += [l for l in lines if l.get("bench") == "gpu_train_2proc"]

    # The goals are SGD's (the runs that torch.compile also runs); other optimizers inform.
    verdicts = [v for row in rows if row["optimizer"] == "sgd" for v in row["goals"].values()]
    return {
        "bench": "gpu_summary",
        "goals_met": None if not verdicts or None in verdicts else all(verdicts),
        "rows": rows,
        "two_process": two,
        "errors": len(errors),
        "error_lines": errors[:20],
        "results": len(results),
    }


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.strip().splitlines()[-2])
    lines, bad = load(sys.argv[1])
    summary = summarize(lines)
    summary["unreadable_lines"] = bad
    text = json.dumps(summary, indent=1)
    if len(sys.argv) == 3:
        with open(sys.argv[2], "w") as f:
            f.write(text + "\n")
    for row in summary["rows"]:
        bf16 = row["ratios"]["mixed_bfloat16"]
        print(f"{row['model']:>8} @ {row['batch']:<5} {row['optimizer']:<5} bf16: flotilla best / torch-eager "
              f"{bf16['flotilla_best/torch-eager']}, / torch-compile "
              f"{bf16['flotilla_best/torch-compile']}, / torch-compile-graphs "
              f"{bf16['flotilla_best/torch-compile-graphs']}")
    print(f"goals met: {summary['goals_met']}; {summary['results']} results, "
          f"{summary['errors']} error lines")


if __name__ == "__main__":
    main()
