"""Checks summarize.py on a hand-made bench.jsonl: medians of reruns, best of graph on/off,
goals, missing peers, error and cut-off lines, two-process scaling.
Run: python3 bench/gpu/summarize_test.py (exit 0 when all pass)."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import summarize  # noqa: E402


def line(impl, model, batch, precision, rate, graph=False, workers=1, **extra):
    return {"bench": "gpu_train", "impl": impl, "model": model, "batch": batch,
            "precision": precision, "cuda_graph": graph, "workers": workers,
            "samples_per_s": rate, "step_ms": 1000 * batch / rate, **extra}


LINES = [
    # cnn@256: reruns of graph-off (median 1100), graph on faster (1300): best is 1300.
    line("flotilla", "cnn", 256, "mixed_bfloat16", 1000),
    line("flotilla", "cnn", 256, "mixed_bfloat16", 1100),
    line("flotilla", "cnn", 256, "mixed_bfloat16", 1200),
    line("flotilla", "cnn", 256, "mixed_bfloat16", 1300, graph=True),
    line("torch-eager", "cnn", 256, "mixed_bfloat16", 1000),
    line("torch-compile", "cnn", 256, "mixed_bfloat16", 1400),
    line("flotilla", "cnn", 256, "float32", 500),
    line("torch-eager", "cnn", 256, "float32", 400),
    # mlp-wide@1024: no torch-compile line (timed out), an error line instead.
    line("flotilla", "mlp-wide", 1024, "mixed_bfloat16", 2200),
    line("torch-eager", "mlp-wide", 1024, "mixed_bfloat16", 2000),
    {"bench": "gpu_train", "impl": "torch-compile", "model": "mlp-wide", "batch": 1024,
     "precision": "mixed_bfloat16", "error": "timed out"},
    # Two processes on one GPU: NCCL refused, the ring ran at 0.8x one worker's rate.
    {"bench": "gpu_train_2proc", "nccl": "refused", "error": "Duplicate GPU detected"},
    line("flotilla", "cnn", 256, "mixed_bfloat16", 880, workers=2, implementation="RING"),
]


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.jsonl")
        with open(path, "w") as f:
            f.write("[worker 0] a log line, not JSON\n")
            for l in LINES:
                f.write(json.dumps(l) + "\n")
            f.write('{"bench": "gpu_train", "impl": "flot')  # cut off by a timeout
        out = os.path.join(tmp, "summary.json")
        subprocess.run([sys.executable, os.path.join(HERE, "summarize.py"), path, out],
                       check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            s = json.load(f)

    rows = {(r["model"], r["batch"]): r for r in s["rows"]}
    assert set(rows) == {("cnn", 256), ("mlp-wide", 1024)}, rows.keys()
    cnn = rows[("cnn", 256)]
    assert cnn["samples_per_s"]["mixed_bfloat16"]["flotilla"] == 1100.0, cnn
    bf16 = cnn["ratios"]["mixed_bfloat16"]
    assert bf16["flotilla_best/torch-eager"] == 1.3, bf16
    assert bf16["flotilla_best/torch-compile"] == round(1300 / 1400, 3), bf16
    assert cnn["goals"] == {"bf16 vs torch-eager >= 1.1": True,
                            "bf16 vs torch-compile >= 1.0": False,
                            "bf16 vs torch-compile-graphs >= 1.0": None}, cnn["goals"]
    assert cnn["cuda_graph_speedup"]["mixed_bfloat16"] == round(1300 / 1100, 3)
    assert cnn["ratios"]["float32"]["flotilla_best/torch-eager"] == 1.25
    assert cnn["ratios"]["mixed_float16"]["flotilla_best/torch-eager"] is None
    wide = rows[("mlp-wide", 1024)]
    assert wide["ratios"]["mixed_bfloat16"]["flotilla_best/torch-eager"] == 1.1
    assert wide["goals"]["bf16 vs torch-compile >= 1.0"] is None  # missing, not failed
    assert s["goals_met"] is None  # a goal could not be judged
    assert s["errors"] == 2 and s["unreadable_lines"] == 1, (s["errors"], s["unreadable_lines"])
    two = s["two_process"]
    assert two[0]["scaling_vs_one_worker"] == 0.8 and two[0]["implementation"] == "RING", two
    assert two[1]["nccl"] == "refused", two
    # One worker's lines only in rows: the 2-worker cnn line did not change the median.
    assert summarize.median_rate(summarize.pick(
        [l for l in LINES if l.get("workers") == 1], impl="flotilla", model="cnn",
        precision="mixed_bfloat16", cuda_graph=False)) == 1100
    print("summarize_test: ok")


if __name__ == "__main__":
    main()
