"""The course site: built with the README's docs command, then read in a real browser (headless Chromium, driven
over the Chrome DevTools protocol on a pipe: no network, no extra package).

Checked on every page as Chromium renders it: every ``<a href>`` into the site and every ``<img src>`` resolves to
a file of the build (and a ``#fragment`` to an element of that page), every image decodes; every notebook page
shows as many figures as the committed notebook has image outputs; the start page renders with the theme's style
and scripts and its navigation reaches every notebook; search answers a query.

Needs the ``[docs]`` extra and Debian's ``chromium``: under ``CI=true`` (``.ci/run`` installs both) a missing one
fails the test; elsewhere it is skipped, with the reason shown as a warning too.
"""

import base64
import fcntl
import importlib.util
import io
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
IMAGE_TYPES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _require(ok: bool, reason: str) -> None:
    if ok:
        return
    if _in_ci():
        pytest.fail(f"{reason} (CI must run the site's test: the test command installs the docs extra, "
                    ".ci/run installs chromium)")
    warnings.warn(f"tests/test_site.py skipped: {reason}", stacklevel=2)
    pytest.skip(reason)


def _chromium() -> str | None:
    for name in (os.environ.get("FLASHNB_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def docs_command() -> str:
    """The sphinx-build call of the README's docs command (the block after ``<!-- docs-command -->``)."""
    block = README.split("<!-- docs-command -->", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    build = block.split("&&")[-1].strip()
    assert build.startswith("sphinx-build ") and build.endswith(" build/site"), block
    return build


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    missing = [m for m in ("sphinx", "myst_nb", "sphinx_book_theme") if importlib.util.find_spec(m) is None]
    _require(not missing, f"the docs extra is not installed ({', '.join(missing)}): pip install -e \".[docs]\"")
    _require(_chromium() is not None, "no Chromium: apt-get install chromium (Debian's package)")
    out = tmp_path_factory.mktemp("site") / "site"
    argv = docs_command().split()
    argv = [sys.executable, "-m", "sphinx", *argv[1:-1], str(out)]
    start = time.perf_counter()
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"the docs build failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    print(f"site built in {time.perf_counter() - start:.0f} s")
    assert (out / "index.html").is_file() and (out / "docs" / "start.html").is_file()
    return out


class Browser:
    """Headless Chromium over the DevTools protocol on a pipe (``--remote-debugging-pipe``: Chromium reads commands
    on fd 3 and writes answers on fd 4, each a JSON message ended by a NUL byte)."""

    def __init__(self, exe: str):
        self.profile = tempfile.mkdtemp(prefix="flashnb-chromium-")
        to_r, self.to_w = os.pipe()
        self.from_r, from_w = os.pipe()
        hi_r, hi_w = fcntl.fcntl(to_r, fcntl.F_DUPFD, 100), fcntl.fcntl(from_w, fcntl.F_DUPFD, 100)

        def fds():
            os.dup2(hi_r, 3)
            os.dup2(hi_w, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--disable-extensions", "--remote-debugging-pipe", f"--user-data-dir={self.profile}",
             "--window-size=1280,900", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False,
            preexec_fn=fds)
        for fd in (to_r, from_w, hi_r, hi_w):
            os.close(fd)
        self.buffer = b""
        self.next_id = 0
        self.events: list = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Runtime.enable", session=True)

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self.buffer:
            ready, _, _ = select.select([self.from_r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self.from_r, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed its DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, *, session: bool = False, timeout: float = 60, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self.to_w, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            answer = self._read(deadline)
            if answer.get("id") == self.next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer.get("result", {})
            self.events.append(answer)

    def open(self, url: str, timeout: float = 60) -> None:
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(self._read(deadline))

    def evaluate(self, expression: str, timeout: float = 60):
        result = self.call("Runtime.evaluate", session=True, expression=expression, awaitPromise=True,
                           returnByValue=True, timeout=timeout)
        if "exceptionDetails" in result:
            raise RuntimeError(f"script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", session=True, format="png")["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except Exception:  # noqa: BLE001  (closing anyway below)
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.to_w)
        os.close(self.from_r)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(site):
    b = Browser(_chromium())
    yield b
    b.close()


# What a page looks like once Chromium has rendered it: every link and image (lazy images made eager and awaited).
PAGE_STATE = """(async () => {
  const imgs = [...document.images];
  imgs.forEach(i => { i.loading = 'eager'; });
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  return {
    title: document.title,
    h1: (document.querySelector('article h1, main h1') || {}).textContent || '',
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
    images: imgs.map(i => ({src: i.src, ok: i.complete && i.naturalWidth > 0,
                            output: !!i.closest('.cell_output')})),
    ids: [...document.querySelectorAll('[id]')].map(e => e.id),
    names: [...document.querySelectorAll('a[name]')].map(e => e.getAttribute('name')),
    font: getComputedStyle(document.body).fontFamily,
    theme: document.documentElement.dataset.theme || '',
    text: document.body.innerText.length,
  };
})()"""


def _local(url: str, site: Path) -> tuple[Path, str] | None:
    """(file, fragment) of a link into the built site; None for a link elsewhere (http, mailto, javascript)."""
    parts = urlsplit(url)
    if parts.scheme != "file":
        return None
    path = Path(unquote(parts.path))
    assert path.resolve().is_relative_to(site.resolve()), f"a link leaves the site: {url}"
    return path, unquote(parts.fragment)


def _pages(site: Path) -> list[Path]:
    """The built pages (not the theme's templates copied into _static, nor the copied sources)."""
    return [p for p in sorted(site.rglob("*.html")) if p.relative_to(site).parts[0] not in ("_static", "_sources")]


def _read_all(site: Path, browser: Browser) -> dict:
    states = {}
    for page in _pages(site):
        if page == site / "index.html":    # it only redirects to the start page (test_the_start_page_renders)
            continue
        browser.open(page.as_uri())
        states[page] = browser.evaluate(PAGE_STATE)
    return states


@pytest.fixture(scope="module")
def pages(site, browser):
    return _read_all(site, browser)


def test_no_broken_link_or_image(site, pages):
    """Every link into the site reaches a file (and its fragment an element of that page); every image decodes."""
    assert len(pages) >= len(NOTEBOOKS) + 10, sorted(p.name for p in pages)
    anchors = {p.resolve(): set(s["ids"]) | set(s["names"]) for p, s in pages.items()}
    broken, checked = [], 0
    for page, state in pages.items():
        where = page.relative_to(site)
        for url in state["links"]:
            target = _local(url, site)
            if target is None:
                continue
            path, fragment = target
            checked += 1
            if path.is_dir():
                path = path / "index.html"
            if not path.is_file():
                broken.append(f"{where}: link to {path.relative_to(site)} (no such file)")
            elif fragment and path.suffix == ".html" and fragment not in anchors.get(path.resolve(), set()):
                broken.append(f"{where}: link to {path.relative_to(site)}#{fragment} (no such anchor)")
        for img in state["images"]:
            target = _local(img["src"], site)
            if target is not None and not target[0].is_file():
                broken.append(f"{where}: image {img['src']} (no such file)")
            elif not img["ok"]:
                broken.append(f"{where}: image {img['src']} does not load")
    assert checked > 1000, f"only {checked} internal links found: is the navigation rendered?"
    assert not broken, f"{len(broken)} broken:\n" + "\n".join(sorted(set(broken))[:40])


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.refs = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        key = {"a": "href", "img": "src", "link": "href", "script": "src"}.get(tag)
        if key and a.get(key):
            self.refs.append(a[key])


def test_the_built_files_link_only_to_files_of_the_build(site):
    """The HTML as written (before any script runs): every relative href/src of every page resolves to a file."""
    broken = []
    for page in _pages(site):
        parser = _Links()
        parser.feed(page.read_text())
        for ref in parser.refs:
            parts = urlsplit(ref)
            if parts.scheme or parts.netloc or not parts.path:
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {ref}")
    assert not broken, f"{len(broken)} broken:\n" + "\n".join(broken[:40])


def _figures(notebook: Path) -> int:
    """Image outputs committed in the notebook (what its page must show)."""
    cells = json.loads(notebook.read_text())["cells"]
    return sum(1 for c in cells for o in c.get("outputs", ()) if any(t in o.get("data", {}) for t in IMAGE_TYPES))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name[:2])
def test_every_notebook_page_shows_its_figures(site, pages, notebook):
    page = site / "notebooks" / f"{notebook.stem}.html"
    assert page in pages, f"no page for {notebook.name}"
    state = pages[page]
    expected = _figures(notebook)
    assert expected >= 1, f"{notebook.name} has no committed figure (run scripts/execute_notebooks.py)"
    shown = [i for i in state["images"] if i["output"]]
    assert len(shown) == expected, f"{notebook.name}: {len(shown)} figures on its page, {expected} in the notebook"
    assert all(i["ok"] for i in shown), f"{notebook.name}: a figure does not load: {shown}"
    first_heading = next(line for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "markdown"
                         for line in "".join(c["source"]).splitlines() if line.startswith("# "))
    assert state["h1"].strip().rstrip("#").strip() == first_heading[2:].replace("`", "").strip()


def test_the_start_page_renders(site, pages, browser):
    state = pages[site / "docs" / "start.html"]
    title = (ROOT / "docs" / "start.md").read_text().splitlines()[0].lstrip("# ").strip()
    assert state["h1"].strip().rstrip("#").strip() == title
    assert state["theme"] in ("light", "dark"), "the theme's script did not run"
    assert "serif" not in state["font"].replace("sans-serif", ""), f"the theme's stylesheet is missing: {state['font']}"
    assert state["text"] > 3000, "the start page has almost no text"
    for notebook in NOTEBOOKS:                         # the navigation reaches every notebook
        target = (site / "notebooks" / f"{notebook.stem}.html").as_uri()
        assert target in state["links"], f"the start page does not link {notebook.stem}"
    # the site's root sends the reader to the start page
    browser.open((site / "index.html").as_uri())
    deadline = time.monotonic() + 20
    while not browser.evaluate("location.href").endswith("docs/start.html"):
        assert time.monotonic() < deadline, "index.html does not lead to the start page"
        time.sleep(0.2)
    # and it is not blank: the screenshot has text and colour, not one flat tone
    browser.open((site / "docs" / "start.html").as_uri())
    import matplotlib.image as mpimg
    import numpy as np

    pixels = mpimg.imread(io.BytesIO(browser.screenshot()), format="png")
    assert pixels.shape[0] >= 800 and pixels.shape[1] >= 1200
    assert np.std(pixels[..., :3]) > 0.05, "the start page's screenshot is blank"


def test_search_answers(site, browser):
    browser.open((site / "search.html").as_uri() + "?q=online+softmax")
    deadline = time.monotonic() + 30
    hits: list = []
    while not hits:
        assert time.monotonic() < deadline, "search found nothing for 'online softmax'"
        time.sleep(0.3)
        hits = browser.evaluate("[...document.querySelectorAll('#search-results li a')].map(a => a.href)")
    assert any("02_online_softmax" in h for h in hits), hits


def test_the_reference_pages_cover_the_command_line_and_the_api(site, pages):
    """The generated pages rendered: a section for every command of ``flashnb``'s parser, with its options; an
    entry for every public function of ``flashnb`` and of ``flashnb.api``; the navigation reaches both."""
    import argparse
    import inspect

    import flashnb
    from flashnb import api, cli

    cli_page = site / "site" / "_generated" / "cli.html"
    text = cli_page.read_text()

    def commands(parser, prefix):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield f"{prefix} {name}", child
                    yield from commands(child, f"{prefix} {name}")

    found = list(commands(cli.build_parser(), "flashnb"))
    assert len(found) >= 8, [c for c, _ in found]
    for command, parser in found:
        assert command in text, f"the command-line reference has no section for {command!r}"
        for action in parser._actions:
            for option in action.option_strings:
                assert option in text, f"{command}: {option} is missing from the command-line reference"
    api_ids = set(pages[site / "site" / "_generated" / "api" / "flashnb.html"]["ids"])
    public = [f"flashnb.{n}" for n in flashnb.__all__ if inspect.isfunction(getattr(flashnb, n))]
    public += [f"flashnb.api.{n}" for n in api.__all__ if inspect.isfunction(getattr(api, n))]
    assert len(public) >= 6 and not set(public) - api_ids, sorted(set(public) - api_ids)
    start_links = pages[site / "docs" / "start.html"]["links"]
    for page in (cli_page, site / "site" / "_generated" / "api" / "index.html"):
        assert page.as_uri() in start_links, f"the navigation does not reach {page.relative_to(site)}"
