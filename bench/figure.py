#!/usr/bin/env python3
"""docs/benchmarks.svg: the figure of docs/benchmarks.md, drawn from its own tables, so the two
cannot disagree. Every table whose header has an "x DDP best" column gives one bar per row:
flotilla's samples/s over PyTorch DDP at its best, at the row's model, batch and precision (each
side at the row's precision), grouped by table, with the goal's 1.2x marked. Standard library
only (an SVG written by hand).

Usage: bench/figure.py [docs/benchmarks.md] [docs/benchmarks.svg]
"""
import html
import re
import sys

BAR, GAP, LEFT, WIDTH, SCALE_MAX = 16, 4, 330, 820, None


def tables(markdown):
    """(heading, header cells, rows of cells) for each table, under the nearest ## heading."""
    heading, header, rows, out = "", None, [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("## "):
            heading = line[3:].strip()
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
            elif not set("".join(cells)) <= set("-: "):
                rows.append(cells)
            continue
        if header is not None:
            out.append((heading, header, rows))
        header, rows = None, []
    return out


def bars(markdown):
    groups = []
    for heading, header, rows in tables(markdown):
        if "x DDP best" not in header:
            continue
        at = header.index("x DDP best")
        label_cols = [header.index(c) for c in ("model", "global batch", "precision (every side)")
                      if c in header]
        items = []
        for row in rows:
            match = re.match(r"[0-9.]+", row[at].replace("*", ""))
            if not match:
                continue
            label = " ".join(row[i].replace("mixed_bfloat16", "bf16") for i in label_cols)
            items.append((label, float(match.group())))
        if items:
            groups.append((heading, items))
    return groups


def svg(groups):
    top = max([ratio for _, items in groups for _, ratio in items] + [2.0])
    scale = (WIDTH - LEFT - 60) / top
    y, parts = 30, []
    for heading, items in groups:
        parts.append(f'<text x="8" y="{y + 12}" font-weight="bold">{html.escape(heading[:110])}</text>')
        y += 22
        for label, ratio in items:
            w = ratio * scale
            color = "#2b7bb9" if ratio >= 1.2 else "#d9822b"
            parts.append(f'<text x="{LEFT - 8}" y="{y + 12}" text-anchor="end">{html.escape(label)}</text>')
            parts.append(f'<rect x="{LEFT}" y="{y}" width="{w:.1f}" height="{BAR}" fill="{color}"/>')
            parts.append(f'<text x="{LEFT + w + 4:.1f}" y="{y + 12}">{ratio:.2f}x</text>')
            y += BAR + GAP
        y += 10
    height = y + 10
    for mark, style, anchor, dx in ((1.0, "#888", "end", -3), (1.2, "#c00", "start", 3)):
        x = LEFT + mark * scale
        parts.append(f'<line x1="{x:.1f}" y1="22" x2="{x:.1f}" y2="{height - 10}" stroke="{style}" '
                     'stroke-dasharray="4,3"/>')
        parts.append(f'<text x="{x + dx:.1f}" y="16" fill="{style}" text-anchor="{anchor}">'
                     f'{mark:.1f}x{" (goal)" if mark > 1 else ""}</text>')
    title = ("flotilla's training samples/s over PyTorch DDP at its best, same model, batch, "
             "precision and machine (docs/benchmarks.md)")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'font-family="sans-serif" font-size="12">\n<title>{html.escape(title)}</title>\n'
            f'<rect width="100%" height="100%" fill="white"/>\n' + "\n".join(parts) + "\n</svg>\n")


def main():
    source = sys.argv[1] if len(sys.argv) > 1 else "docs/benchmarks.md"
    target = sys.argv[2] if len(sys.argv) > 2 else "docs/benchmarks.svg"
    with open(source) as f:
        groups = bars(f.read())
    if not groups:
        sys.exit(f"{source}: no table with an 'x DDP best' column")
    with open(target, "w") as f:
        f.write(svg(groups))
    print(f"{target}: {sum(len(items) for _, items in groups)} bars in {len(groups)} groups")


if __name__ == "__main__":
    main()
