"""Helpers for the network-namespace scenarios (lib.sh): a TCP connectivity probe, and the
comparisons of a run's results with a reference run's. Exit status 0 = agree, 1 = differ (the
one line printed says by how much and where)."""
import json
import os
import re
import socket
import sys
import time


def serve(port, count, timeout):
    """Accepts `count` connections, each closed by the sender."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port))
    s.listen(count)
    s.settimeout(timeout)
    for _ in range(count):
        c, _ = s.accept()
        c.settimeout(timeout)
        while c.recv(1 << 16):
            pass
        c.close()


def send(host, port, timeout):
    # The listener may not be up yet: retry until the deadline.
    deadline = time.monotonic() + timeout
    while True:
        try:
            c = socket.create_connection((host, port), timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    c.sendall(b"probe")
    c.close()


def newest_checkpoint(directory):
    """<directory>/ckpt-N with the largest N."""
    numbers = [int(m.group(1)) for m in
               (re.fullmatch(r"ckpt-(\d+)", n) for n in os.listdir(directory)) if m]
    if not numbers:
        raise SystemExit(f"no ckpt-N checkpoint in {directory}")
    return os.path.join(directory, f"ckpt-{max(numbers)}")


def weights(dir_a, dir_b, tol):
    from safetensors.numpy import load_file
    import numpy as np

    path_a, path_b = newest_checkpoint(dir_a), newest_checkpoint(dir_b)
    a = load_file(os.path.join(path_a, "model.safetensors"))
    b = load_file(os.path.join(path_b, "model.safetensors"))
    if sorted(a) != sorted(b):
        print(f"different tensors: {sorted(a)} in {path_a} vs {sorted(b)} in {path_b}")
        return 1
    worst, where, identical = 0.0, None, True
    for name in sorted(a):
        x, y = a[name].astype(np.float64), b[name].astype(np.float64)
        if x.shape != y.shape:
            print(f"{name}: shape {x.shape} in {path_a} vs {y.shape} in {path_b}")
            return 1
        identical = identical and np.array_equal(a[name], b[name])
        scale = np.abs(y).max() if y.size else 0.0
        diff = np.abs(x - y).max() if x.size else 0.0
        rel = diff / scale if scale > 0 else diff
        if rel > worst or where is None:
            worst, where = rel, name
    verdict = "bit-identical" if identical else f"max relative difference {worst:.3g} ({where})"
    line = (f"{len(a)} tensors, {sum(v.size for v in a.values())} values, {verdict}; "
            f"{os.path.basename(path_a)} vs {os.path.basename(path_b)}, tolerance {tol:g}")
    print(line)
    return 0 if worst <= tol else 1


def read_metrics(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    epochs = [o for o in lines if "epoch" in o and "evaluator_checkpoint" not in o]
    tests = [o for o in lines if "test_loss" in o]
    return epochs, tests


def metrics(path_a, path_b, tol, parts):
    """The last epoch's loss/accuracy (parts has 'epoch') and the test result (parts has 'test')
    of two --metrics-json files agree within tol (relative)."""
    ea, ta = read_metrics(path_a)
    eb, tb = read_metrics(path_b)
    pairs = []
    if "epoch" in parts:
        if not ea or not eb:
            print(f"no epoch line in {path_a if not ea else path_b}")
            return 1
        if ea[-1]["epoch"] != eb[-1]["epoch"]:
            print(f"last epoch {ea[-1]['epoch']} in {path_a} vs {eb[-1]['epoch']} in {path_b}")
            return 1
        pairs += [(f"epoch {ea[-1]['epoch']} {k}", ea[-1][k], eb[-1][k])
                  for k in ("loss", "accuracy")]
    if "test" in parts:
        if not ta or not tb:
            print(f"no test line in {path_a if not ta else path_b}")
            return 1
        pairs += [(k, ta[-1][k], tb[-1][k]) for k in ("test_loss", "test_accuracy")]
    bad = [f"{k}: {x!r} vs {y!r}" for k, x, y in pairs
           if abs(x - y) > tol * max(abs(x), abs(y), 1e-30)]
    shown = ", ".join(f"{k} {x:.6f}" for k, x, _ in pairs)
    if bad:
        print(f"differ beyond {tol:g}: " + "; ".join(bad))
        return 1
    print(f"equal within {tol:g}: {shown}")
    return 0


def elastic(out, ref, tol, epochs, samples, slots, processes):
    """tests/multiworker/elastic_trainer's results: every slot's final weights equal the
    one-worker reference's within tol (absolute, float32), there is one ledger per process
    started (ledger-<pid>.txt: "epoch id id ..." per committed step), and together they hold
    each sample once per epoch."""
    from safetensors.numpy import load_file
    import numpy as np

    expected = load_file(os.path.join(ref, "weights-0.safetensors"))
    worst = 0.0
    for slot in range(slots):
        got = load_file(os.path.join(out, f"weights-{slot}.safetensors"))
        if sorted(got) != sorted(expected):
            print(f"slot {slot}: tensors {sorted(got)} vs the reference's {sorted(expected)}")
            return 1
        for name, t in expected.items():
            worst = max(worst, float(np.abs(got[name].astype(np.float64) - t).max()))
    trained = {}
    ledgers = [n for n in os.listdir(out) if n.startswith("ledger-")]
    for name in ledgers:
        for line in open(os.path.join(out, name)):
            epoch, *ids = map(int, line.split())
            for i in ids:
                trained[(epoch, i)] = trained.get((epoch, i), 0) + 1
    lost = epochs * samples - len(trained)
    repeated = sum(n - 1 for n in trained.values())
    print(f"{slots} slots' weights within {worst:.3g} of the one-worker run's (tolerance {tol:g}); "
          f"{len(ledgers)} ledgers: {lost} samples lost, {repeated} trained twice")
    if len(ledgers) != processes:
        print(f"{len(ledgers)} ledgers, not {processes}: a process was started that should not "
              "have been, or one never trained")
        return 1
    return 0 if worst < tol and lost == 0 and repeated == 0 else 1


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "serve":
        serve(int(args[0]), int(args[1]), float(args[2]))
    elif cmd == "send":
        send(args[0], int(args[1]), float(args[2]))
    elif cmd == "weights":
        return weights(args[0], args[1], float(args[2]))
    elif cmd == "elastic":
        return elastic(args[0], args[1], float(args[2]), *map(int, args[3:7]))
    elif cmd == "metrics":
        return metrics(args[0], args[1], float(args[2]), args[3].split(","))
    else:
        raise SystemExit(f"unknown command {cmd}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
