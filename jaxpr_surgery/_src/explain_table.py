"""The text form of an `explain` report: a table that fits a terminal, then footnotes.

One line per parameter leaf (path, shape, kind, rule, a footnote number, predicted extra
memory); the footnotes give, once for every group of leaves that run the same way, each
statistic's rule and how it runs, or why a leaf falls back. ``width=None`` abbreviates and
wraps nothing. Everything printed is also in ``Report.as_dict()``.
"""

from __future__ import annotations

import re
import textwrap

DEFAULT_WIDTH = 100
MIN_WIDTH = 80
_GAP = "  "
_NBSP = "\xa0"  # joins a number to its unit while wrapping; a space again once wrapped
_ELLIPSIS = "..."
_MIN_PATH = 24  # shape and kind columns are cut before the paths get narrower than this
_MAX_SHAPE = 16
_MAX_KIND = 24
_MIN_CELL = 5  # the narrowest a cut shape or kind gets
_UNIT = re.compile(r"(\d) (B|KiB|MiB|GiB|TiB|FLOPs)\b")  # kept on one line when wrapped
_TOKEN = re.compile(r"\[[^\]]*\]|\.[^.\[]+")  # one entry of a jax.tree_util.keystr path


def render(report, width: int | None = DEFAULT_WIDTH) -> str:
    """``report`` as text, every line at most ``width`` columns (``None``: no limit)."""
    if width is not None and (not isinstance(width, int) or width < MIN_WIDTH):
        raise ValueError(
            f"Report.format: width must be an int of at least {MIN_WIDTH} columns, or None "
            f"for no limit; got {width!r}"
        )
    notes, keys = [], {}
    refs = []
    for leaf in report.leaves:
        key, lines = _footnote(leaf, report.statistics)
        if key not in keys:
            keys[key] = len(notes) + 1
            notes.append(lines)
        refs.append(f"[{keys[key]}]")
    head = ("leaf", "shape", "kind", "rule", "how", "extra mem")
    rows = [
        (
            leaf.path,
            _shape(leaf.shape),
            _kinds(leaf.kinds),
            leaf.rule,
            ref,
            _bytes(leaf.extra_bytes),
        )
        for leaf, ref in zip(report.leaves, refs)
    ]
    widths = [max(len(r[k]) for r in rows + [head]) for k in range(len(head))]
    budget = None
    if width is not None:  # cut shapes and kinds first, then fit the paths in what is left
        room = width - sum(widths[3:]) - len(_GAP) * (len(head) - 1)
        shape_w, kind_w = min(widths[1], _MAX_SHAPE), min(widths[2], _MAX_KIND)
        while room - shape_w - kind_w < _MIN_PATH and max(shape_w, kind_w) > _MIN_CELL:
            if kind_w >= shape_w:
                kind_w -= 1
            else:
                shape_w -= 1
        rows = [(r[0], _elide(r[1], shape_w), _elide(r[2], kind_w)) + r[3:] for r in rows]
        widths[1:3] = [max(len(r[k]) for r in rows + [head]) for k in (1, 2)]
        budget = room - widths[1] - widths[2]
    if budget is not None and max([len(r[0]) for r in rows] + [0]) > budget:
        empty = ("",) * (len(head) - 1)
        rows = [
            (text,) + (rows[i][1:] if i is not None else empty)
            for text, i in _tree([r[0] for r in rows], budget)
        ]
    widths[0] = max([len(r[0]) for r in rows] + [len(head[0])])

    def line(cells):
        *left, mem = cells
        return _GAP.join([c.ljust(w) for c, w in zip(left, widths)] + [mem.rjust(widths[-1])])

    out = [line(head), line(tuple("-" * w for w in widths))]
    out += [line(r).rstrip() for r in rows]
    if notes:
        out.append("")
    for k, lines in enumerate(notes, 1):
        tag = f"[{k}]"
        for j, text in enumerate(lines):
            indent = " " * (len(tag) + 1)
            out += _wrap(text, width, f"{tag} " if j == 0 else indent, indent + "  ")
    out.append("")
    out += _footer(report, width)
    return "\n".join(out)


def _footnote(leaf, statistics):
    """``(key, lines)``: how a leaf's statistics run, or why it falls back; leaves with
    equal keys share one footnote."""
    if leaf.rule == "fallback":
        reasons = list(leaf.reasons) or [leaf.detail]
        head = (
            "fallback (exact per-example gradients of the leaf through the whole model), because:"
        )
        return ("fallback", tuple(reasons)), [head] + reasons
    if leaf.rule == "skipped":  # a non-float leaf: one line, its dtype
        return ("skipped", leaf.detail), [leaf.detail]
    if not leaf.hows:  # a report made without per-statistic hows: the detail as it is
        return ("detail", leaf.detail), [leaf.detail]
    groups = {}
    for name in dict.fromkeys([n for n in statistics if n in leaf.rules] or leaf.rules):
        groups.setdefault((leaf.rules[name], leaf.hows.get(name, "")), []).append(name)

    def text(word, how):
        return f"{word} ({how})" if how else word

    if len(groups) == 1:
        ((word, how),) = groups
        lines = [text(word, how)]
    else:
        lines = [f"{', '.join(names)}: {text(*wh)}" for wh, names in groups.items()]
    return ("rules", tuple((wh, tuple(n)) for wh, n in groups.items())), lines


def _footer(report, width):
    """Batch and statistics; predicted totals; how the batch and tiles run; the notes."""
    fb = report.fallback_leaves
    lines = [
        f"B={report.batch_size}; statistics: {', '.join(report.statistics)}; "
        f"fallback leaves: {len(fb)}"
        + (f"; skipped leaves: {len(report.skipped_leaves)}"
           if report.skipped_leaves else "")
    ]
    flops, mem = report.total_extra_flops, report.total_extra_bytes
    text = f"predicted extra: {flops:.3g}{_NBSP}FLOPs, {_mib(mem)} temporary memory"
    if report.grad_flops:
        text += f" ({flops / report.grad_flops:.2f}x grad's FLOPs"
        if report.grad_temp_bytes:
            text += f", {mem / report.grad_temp_bytes:.2f}x its temporary memory"
        text += ")"
    lines.append(text)
    tiles = f"tiles sized by memory_budget_bytes={_mib(report.memory_budget_bytes)}"
    if report.activation_bytes_per_example is not None:
        act = _mib(report.activation_bytes_per_example)
        chunks = (
            f"batch run in chunks of {report.chunk_size} examples"
            if report.chunk_size
            else "batch run whole"
        )
        tiles = f"{chunks} (activations ~{act} per example); {tiles}"
    lines.append(tiles)
    lines.extend(report.notes)
    return [w for text in lines for w in _wrap(text, width, "", "  ")]


def _wrap(text, width, first="", rest=""):
    """``text`` in lines of at most ``width`` columns (one line with ``width=None``)."""
    if width is None:
        return [(first + text).replace(_NBSP, " ")]
    text = _UNIT.sub(rf"\1{_NBSP}\2", text).replace(" / ", _NBSP + "/ ")
    lines = textwrap.wrap(
        text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
    ) or [first.rstrip()]
    return [ln.replace(_NBSP, " ") for ln in lines]


def _mib(b):
    return f"{b / 2**20:.3g}{_NBSP}MiB"


def _bytes(b):
    """``1.5 KiB``, ``12 MiB``, ``0``: at most 8 characters."""
    if b is None:
        return "?"
    if b == 0:
        return "0"
    units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]
    u = 0
    while b >= 1024 and u < len(units) - 1:
        b, u = b / 1024, u + 1
    if u == 0:
        return f"{b:.0f} B"
    return f"{b:.1f} {units[u]}" if b < 100 else f"{b:.0f} {units[u]}"


def _shape(shape):
    return "x".join(map(str, shape)) or "()"


def _kinds(kinds):
    """``embedding+dense``; a kind found at several sites once, with its count."""
    counts = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    return "+".join(k if n == 1 else f"{k} x{n}" for k, n in counts.items()) or "-"


def _elide(text, n):
    """``text`` cut from the middle to ``n`` characters."""
    if len(text) <= n:
        return text
    tail = (n - len(_ELLIPSIS)) * 2 // 3
    head = n - len(_ELLIPSIS) - tail
    return text[:head] + _ELLIPSIS + text[len(text) - tail :]


def _tokens(path):
    toks = _TOKEN.findall(path)
    return toks if "".join(toks) == path else [path]


def _tree(paths, budget):
    """``[(text, leaf index or None)]``: the paths as a tree whose every line fits
    ``budget`` columns. A line holds the entries of the path that its leaves share
    below its parent line (indented two columns deeper), and a leaf line the rest of
    its path, split over more lines where it is too long: the whole path is the labels
    from the root. A single entry still too long is cut from the middle."""
    toks = [_tokens(p) for p in paths]
    out = []

    def grow(members, start, depth):
        indent = "  " * min(depth, (budget - 8) // 2)  # a label keeps at least 8 columns
        groups = {}
        for i in members:
            groups.setdefault(toks[i][start], []).append(i)
        for group in groups.values():
            first = toks[group[0]]
            end = len(first) if len(group) == 1 else start + 1
            while (
                len(group) > 1
                and all(len(toks[i]) > end + 1 for i in group)
                and len({toks[i][end] for i in group}) == 1
            ):
                end += 1
            while end - start > 1 and len(indent) + len("".join(first[start:end])) > budget:
                end -= 1
            label = indent + _elide("".join(first[start:end]), budget - len(indent))
            ended = [i for i in group if len(toks[i]) == end]
            out.extend((label, i) for i in ended)
            if not ended:
                out.append((label, None))
            rest = [i for i in group if len(toks[i]) > end]
            if rest:
                grow(rest, end, depth + 1)

    grow(list(range(len(paths))), 0, 0)
    return out
