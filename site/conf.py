"""Sphinx configuration of flashnb's documentation site.

Build it from the repository root (the README's docs command)::

    sphinx-build -q -b html -c site . build/site

The source folder is the repository itself, so the pages link to each other exactly as they do on GitHub: the start
page (``docs/start.md``, the site's root), the reference pages (``docs/*.md``), the notebooks with their committed
outputs (``notebooks/*.ipynb``, never executed here), the README, the course kit's pages and CONTRIBUTING.md. Two
kinds of page are written at build time into ``site/_generated/`` (not committed): the command-line reference,
from ``flashnb.cli.build_parser()``, and the API reference, one page per package (``flashnb`` and its top-level
modules, ``stages``, ``kernels``, ``instruments``, ``sim``, ``pytorch``, ``distributed``), from the docstrings.
PyTorch and transformers are mocked while autodoc imports the modules: the site documents ``flashnb.pytorch`` and
``flashnb.distributed`` the same whether or not they are installed (checked: the same entries either way), and the
build does not spend its time importing them.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import site_pages  # noqa: E402  (site/site_pages.py: the generated pages and the navigation)

project = "flashnb"
author = "the flashnb authors"
copyright = "the flashnb authors"
root_doc = "docs/start"

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.githubpages"]

# The pages of the site, every other file of the repository left out (sphinx walks the source folder, pruning
# excluded folders first, so the virtual environments and build outputs are never read).
include_patterns = ["docs/*.md", "notebooks/*.ipynb", "README.md", "CONTRIBUTING.md", "assignments/*.md",
                    "site/_generated/**"]
exclude_patterns = [".*", "build", "release", "flashnb", "tests", "benchmarks", "results", "scripts", "figures",
                    "**/.ipynb_checkpoints", "**/__pycache__"]

# Notebooks are pages with their committed outputs: nothing is executed at build time.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
suppress_warnings = ["misc.highlighting_failure"]

autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_mock_imports = ["torch", "transformers"]   # see the docstring above
autodoc_inherit_docstrings = False   # a torch.autograd.Function's forward would show PyTorch's own docstring
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "sphinx_book_theme"
html_title = "flashnb"
html_extra_path = ["extra"]          # site/extra/index.html: the site's root sends readers to the start page
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "home_page_in_toc": True,
}
html_show_sourcelink = False
html_copy_source = True            # the download button gives the page's source: a notebook's .ipynb


def setup(app):
    site_pages.write_generated(ROOT)
    app.connect("source-read", site_pages.add_navigation)
    app.connect("doctree-resolved", site_pages.unlink_problems)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
