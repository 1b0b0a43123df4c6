"""The site's generated pages and its navigation (used by ``site/conf.py``).

* :func:`write_generated` writes ``site/_generated/``: the command-line reference from ``flashnb.cli.build_parser()``
  and the API reference, one page per public module, from the docstrings (autodoc);
* :func:`add_navigation` appends the site's table of contents to the start page as Sphinx reads it, so the
  start page stays plain Markdown on GitHub.

Which notebook belongs to the core path and which is an elective is written once, here (``CORE``, ``ELECTIVES``); a
notebook in neither list, or a listed one that does not exist, stops the build with the names.
"""

import io
import os
import shutil
from contextlib import redirect_stdout
from pathlib import Path

# The core path in reading order, then the electives (notebook numbers).
CORE = ("00", "01", "02", "03", "04", "05", "06", "07", "11")
ELECTIVES = ("08", "09", "10", "12", "13")

# Reference pages in reading order; a docs/ page not named here follows them (alphabetically).
REFERENCE = ("kernels", "pytorch", "distributed", "experimenting", "cli", "simulator", "numbers", "testing")

# The API reference: the packages whose public submodules each get a page, and single modules.
API_PACKAGES = ("flashnb.stages", "flashnb.kernels", "flashnb.instruments", "flashnb.sim", "flashnb.pytorch",
                "flashnb.distributed")
API_MODULES = ("flashnb", "flashnb.api", "flashnb.flex", "flashnb.reference", "flashnb.registry", "flashnb.common",
               "flashnb.runtime", "flashnb.rng", "flashnb.regions", "flashnb.notebook", "flashnb.course")

GENERATED = "site/_generated"


def notebooks(root: Path) -> tuple[list[str], list[str]]:
    """The notebooks' document names (``notebooks/NN_name``) on the core path and the electives, in order."""
    found = {p.name[:2]: f"notebooks/{p.stem}" for p in sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))}
    listed = CORE + ELECTIVES
    unlisted = sorted(set(found) - set(listed))
    missing = [n for n in listed if n not in found]
    if unlisted or missing:
        raise RuntimeError(f"site/site_pages.py: notebooks {unlisted} are on neither the core path nor the electives; "
                           f"notebooks {missing} are listed but do not exist")
    return [found[n] for n in CORE], [found[n] for n in ELECTIVES]


def reference_pages(root: Path, root_doc: str) -> list[str]:
    pages = {p.stem for p in (root / "docs").glob("*.md")} - {Path(root_doc).name}
    return [f"docs/{n}" for n in REFERENCE if n in pages] + [f"docs/{n}" for n in sorted(pages - set(REFERENCE))]


def _toctree(caption: str, entries: list[str], prefix: str) -> str:
    lines = "\n".join(f"{prefix}{e}" for e in entries)
    return f"\n\n```{{toctree}}\n:hidden:\n:caption: {caption}\n:maxdepth: 1\n:titlesonly:\n\n{lines}\n```\n"


def add_navigation(app, docname: str, source: list) -> None:
    """Sphinx ``source-read``: the start page gets the site's table of contents (hidden: the sidebar shows it)."""
    if docname != app.config.root_doc:
        return
    root = Path(app.srcdir)
    core, electives = notebooks(root)
    prefix = "/"                                 # absolute document names, from the source folder
    source[0] += (_toctree("The core path", core, prefix) + _toctree("Electives", electives, prefix)
                  + _toctree("Reference", reference_pages(root, app.config.root_doc)
                             + [f"{GENERATED}/cli", f"{GENERATED}/api/index"], prefix)
                  + _toctree("Course kit and project", ["assignments/README", "assignments/CATALOGUE",
                                                        "assignments/EXERCISE_ANSWERS", "README", "CONTRIBUTING"],
                             prefix))


def unlink_problems(app, doctree, docname) -> None:
    """Sphinx ``doctree-resolved``: markup docutils could not read in a docstring (the build warns about each)
    stays as its text, without a link to an error message the page does not show."""
    from docutils import nodes

    for node in list(doctree.findall(nodes.problematic)):
        node.replace_self(nodes.literal(text=node.astext()))


def write_generated(root: Path) -> None:
    out = root / GENERATED
    shutil.rmtree(out, ignore_errors=True)
    (out / "api").mkdir(parents=True)
    (out / "cli.md").write_text(cli_reference())
    pages = api_pages()
    for name, text in pages.items():
        (out / "api" / f"{name}.md").write_text(text)
    index = ["# API reference", "",
             "Generated from the docstrings of flashnb's public modules. The functions most programs need are "
             "`flashnb.attention`, `flashnb.attention_forward` and `flashnb.attention_backward` (the first page); "
             "the stages' modules hold the teaching kernels, `flashnb.kernels` the product kernel.", "",
             "```{toctree}", ":maxdepth: 1", ":titlesonly:", "", *pages, "```", ""]
    (out / "api" / "index.md").write_text("\n".join(index))


# --- the command-line reference ------------------------------------------------------------------------------------

def _subparsers(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _help(parser, argv: list[str]) -> str:
    """The parser's own ``--help`` text; a command that parses its own options is asked through ``main``."""
    if any(a.option_strings == ["-h", "--help"] for a in parser._actions):
        return parser.format_help()
    from flashnb import cli

    buf = io.StringIO()
    with redirect_stdout(buf):
        try:
            cli.main([*argv, "--help"])
        except SystemExit:
            pass
    return buf.getvalue()


def cli_reference() -> str:
    """Every command's ``--help``, as ``flashnb`` prints it in a 100-column terminal."""
    os.environ["COLUMNS"] = "100"
    from flashnb import cli

    parser = cli.build_parser()
    lines = ["# Command-line reference", "",
             "Every `flashnb` command's `--help`, generated from the command line's parser when the site is built "
             "([the command line](../../docs/cli.md) explains what the commands are for).", ""]

    def walk(p, argv):
        title = " ".join(["flashnb", *argv])
        lines.extend([f"{'#' * min(2 + len(argv) - (1 if argv else 0), 4)} `{title}`", "", "```text",
                      _help(p, argv).rstrip(), "```", ""])
        for name, child in _subparsers(p):
            walk(child, [*argv, name])

    walk(parser, [])
    return "\n".join(lines)


# --- the API reference ---------------------------------------------------------------------------------------------

def api_pages() -> dict[str, str]:
    """One page per package (the package, then each public submodule as a section); the top-level modules share
    the first page."""
    import flashnb

    assert flashnb.__all__
    root = Path(flashnb.__file__).resolve().parent.parent
    groups = {"flashnb": list(API_MODULES)}
    for pkg in API_PACKAGES:           # the submodules from the files: listing them imports nothing (torch)
        folder = root.joinpath(*pkg.split("."))
        modules = [p for p in folder.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()]
        groups[pkg] = [pkg] + [f"{pkg}.{p.stem}" for p in sorted(modules)
                               if not p.stem.startswith("_") and p.stem != "selftest"]
    pages = {}
    for page, names in groups.items():
        sections = [f"# `{page}`" if page != "flashnb" else "# `flashnb` and its top-level modules", ""]
        for name in names:
            if name == "flashnb":
                body = (".. automodule:: flashnb\n   :members: attention, attention_forward, attention_backward, "
                        "is_simulator, MODE, MOVED, RENAMED")
            elif name in API_PACKAGES:      # a package re-exports its modules' names: documented there
                body = f".. automodule:: {name}\n   :no-members:"
            else:
                body = f".. automodule:: {name}"
            if name != page:
                sections += [f"## `{name}`", ""]
            sections += ["```{eval-rst}", body, "```", ""]
        pages[page] = "\n".join(sections)
    return pages
