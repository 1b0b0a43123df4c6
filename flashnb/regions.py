"""Named regions of kernel source: the lines a learner writes, a course bug changes or an exercise edits.

A stage kernel marks such lines with a pair of comments, indented like the code between them::

    # region online-update
    m_new = max(m[a], mx)                    # line 9: m_new = max(m_old, rowmax(S))
    ...
    # endregion online-update

Names are short kebab-case words saying what the lines do (``causal-skip``, ``online-update``, ``epilogue``).
Regions may nest (properly: an inner region closes before its outer one).  A function defined in the source
is a region too, addressed by its name (``merge_state``): its body after the docstring, no markers needed.

The course kit (``# flashnb-course: todo REGION "hint"``), its bugs (``Bug(region=...)``) and
:func:`flashnb.registry.variant` (``region=``, ``regions=``) address kernels through these names, so a kernel
can be reformatted outside its regions without breaking the assignments and exercises built on it.

Host-only: nothing here runs on a device.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass

__all__ = ["Region", "RegionError", "parse", "names", "find", "body", "replace_body", "replace_in", "MARKER"]

#: A marker line: ``# region NAME`` or ``# endregion NAME`` (leading spaces aside).
MARKER = re.compile(r"^(?P<indent>[ \t]*)#[ \t]*(?P<kind>region|endregion)\b(?P<rest>.*)$")
_NAME = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


class RegionError(ValueError):
    """A region that is missing, duplicated, unbalanced or nested wrongly (the message names it)."""


@dataclass(frozen=True)
class Region:
    """Where a region's body lies in a source text: lines ``first .. last`` (0-based, ``last`` exclusive)."""

    name: str
    first: int          # first line of the body
    last: int           # one past its last line
    indent: str         # the markers' indentation (a function region: its body's)
    kind: str           # "markers" or "function"


def _where(where: str | None) -> str:
    return f" in {where}" if where else ""


def _known(regions: dict, functions: list) -> str:
    parts = [f"its regions: {', '.join(regions) or 'none'}"]
    if functions:
        parts.append(f"its functions: {', '.join(functions)}")
    return "; ".join(parts)


def parse(source: str, where: str | None = None) -> dict[str, Region]:
    """Every marked region of ``source``, by name, in the order they open.  :class:`RegionError` when a
    marker is malformed, a name is marked twice, a region is never closed or closed in the wrong place."""
    regions: dict[str, Region] = {}
    open_: list[tuple[str, int, str]] = []          # (name, marker line, indent)
    opened_at: dict[str, int] = {}
    for k, line in enumerate(source.splitlines()):
        m = MARKER.match(line)
        if not m:
            continue
        kind, rest, indent = m.group("kind"), m.group("rest").strip(), m.group("indent")
        if not _NAME.fullmatch(rest):
            raise RegionError(f"line {k + 1}{_where(where)}: {line.strip()!r} is not a region marker: write "
                              f"'# {kind} NAME' with a kebab-case NAME (e.g. '# {kind} online-update')")
        if kind == "region":
            if rest in opened_at:
                raise RegionError(f"region {rest!r}{_where(where)} is marked twice (lines {opened_at[rest] + 1} "
                                  f"and {k + 1}): region names must be unique")
            opened_at[rest] = k
            open_.append((rest, k, indent))
            continue
        if not open_:
            raise RegionError(f"'# endregion {rest}' at line {k + 1}{_where(where)} closes no open region"
                              + (f" (region {rest!r} was already closed)" if rest in regions else ""))
        name, start, ind = open_[-1]
        if name != rest:
            if any(n == rest for n, _, _ in open_):
                raise RegionError(f"regions nested wrongly{_where(where)}: '# endregion {rest}' at line {k + 1} "
                                  f"closes {rest!r} while region {name!r} (opened at line {start + 1}, inside it) "
                                  "is still open")
            raise RegionError(f"'# endregion {rest}' at line {k + 1}{_where(where)} closes no open region (the "
                              f"open one is {name!r}, opened at line {start + 1})")
        if indent != ind:
            raise RegionError(f"region {name!r}{_where(where)}: its markers are indented differently (lines "
                              f"{start + 1} and {k + 1}); indent both like the code between them")
        open_.pop()
        regions[name] = Region(name, start + 1, k, ind, "markers")
    if open_:
        name, start, _ = open_[-1]
        raise RegionError(f"region {name!r}{_where(where)} opened at line {start + 1} is never closed "
                          f"('# endregion {name}' missing)")
    return dict(sorted(regions.items(), key=lambda kv: kv[1].first))


def _functions(source: str) -> dict[str, list]:
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return {}
    found: dict[str, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.setdefault(node.name, []).append(node)
    return found


def names(source: str, where: str | None = None) -> list[str]:
    """The marked regions of ``source``, in the order they open (functions, which are regions too, aside)."""
    return list(parse(source, where))


def find(source: str, name: str, where: str | None = None) -> Region:
    """The region ``name`` of ``source``: a marked region, else a function defined in it (its body after the
    docstring).  :class:`RegionError` naming it and listing the regions that exist when there is none."""
    if not isinstance(name, str):
        raise TypeError(f"region must be a region name (a str), got {name!r}")
    regions = parse(source, where)
    functions = _functions(source)
    if name in regions:
        if name in functions:
            raise RegionError(f"{name!r}{_where(where)} is both a marked region and a function: rename one")
        return regions[name]
    if name in functions:
        if len(functions[name]) > 1:
            raise RegionError(f"function {name!r} is defined {len(functions[name])} times{_where(where)}: "
                              "address one of them by a marked region instead")
        node = functions[name][0]
        stmts = node.body
        if (len(stmts) > 1 and isinstance(stmts[0], ast.Expr) and isinstance(stmts[0].value, ast.Constant)
                and isinstance(stmts[0].value.value, str)):
            stmts = stmts[1:]                          # the docstring stays: it says what to write
        lines = source.splitlines()
        first = stmts[0].lineno - 1
        indent = re.match(r"[ \t]*", lines[first]).group(0)
        return Region(name, first, stmts[-1].end_lineno, indent, "function")
    raise RegionError(f"no region {name!r} in the source{_where(where)} ({_known(regions, sorted(functions))})")


def body(source: str, name: str, where: str | None = None) -> str:
    """The lines of region ``name`` (between its markers), each ending in a newline."""
    r = find(source, name, where)
    return "".join(ln + "\n" for ln in source.splitlines()[r.first:r.last])


def _indented(new_body: str, indent: str) -> str:
    """``new_body`` as region lines: a body written without indentation gets the region's; one that is
    indented is kept as written (so it can move code out of a loop)."""
    lines = new_body.strip("\n").splitlines()
    code = [ln for ln in lines if ln.strip()]
    if code and min(len(ln) - len(ln.lstrip()) for ln in code) == 0:
        lines = [indent + ln if ln.strip() else "" for ln in lines]
    return "".join(ln + "\n" for ln in lines)


def replace_body(source: str, name: str, new_body: str, where: str | None = None) -> str:
    """``source`` with the body of region ``name`` replaced by ``new_body`` (the markers stay).  A body written
    without indentation is indented like the region; an indented one is used as written."""
    if not isinstance(new_body, str):
        raise TypeError(f"the new body of region {name!r} must be a str, got {type(new_body).__name__}")
    r = find(source, name, where)
    lines = source.splitlines()
    text = "".join(ln + "\n" for ln in lines[:r.first]) + _indented(new_body, r.indent) \
        + "".join(ln + "\n" for ln in lines[r.last:])
    return text if source.endswith("\n") else text[:-1]


def replace_in(source: str, name: str, old: str, new: str, where: str | None = None) -> str:
    """``source`` with ``old`` replaced by ``new`` inside region ``name``; ``old`` must occur there exactly
    once (:class:`RegionError` otherwise, saying how often it does)."""
    if not (isinstance(old, str) and isinstance(new, str)):
        raise TypeError(f"replace in region {name!r}: old and new must be strings, got {old!r}, {new!r}")
    r = find(source, name, where)
    lines = source.splitlines()
    inside = "".join(ln + "\n" for ln in lines[r.first:r.last])
    n = inside.count(old)
    if n != 1:
        raise RegionError(f"{old!r} occurs {n} times in region {name!r}{_where(where)}; it must occur exactly "
                          "once there (show_source(factory, region=...) prints the region's lines)")
    text = "".join(ln + "\n" for ln in lines[:r.first]) + inside.replace(old, new) \
        + "".join(ln + "\n" for ln in lines[r.last:])
    return text if source.endswith("\n") else text[:-1]
