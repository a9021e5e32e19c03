"""The documentation holds what a user looks for: every public name has a docstring (the API
reference is built from them), every error class is in the troubleshooting guide and the
reference, every algorithm has its page with a row of the benchmark table, and the table cites
no superseded section. ``mkdocs build --strict`` (in ``.ci/run``) checks every link and anchor."""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
import re
import unicodedata

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
#: the packages a user's code or the reference reaches (the top-level folders install into msrl.*)
PACKAGES = ("msrl", "msrl.cluster", "msrl.algorithms", "msrl.distribution_policies", "msrl.fragments")
#: modules that are programs, not libraries (imported only as ``python -m``)
SCRIPTS = ("msrl.envs.native.check",)


def slugify(title: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's ``toc`` slugify, separator ``-``)."""
    value = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def _modules():
    for name in PACKAGES:
        package = importlib.import_module(name)
        yield package
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            if info.name not in SCRIPTS:
                yield importlib.import_module(info.name)


def _public(module):
    """(qualified name, object) of each public function and class ``module`` defines: its
    ``__all__``, or else its names without a leading underscore; with each public method and
    property a class defines itself."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)) or obj.__module__ != module.__name__:
            continue
        yield f"{module.__name__}.{name}", obj
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(value, property) or inspect.isfunction(getattr(value, "__func__", value)):
                    yield f"{module.__name__}.{name}.{attr}", value if isinstance(value, property) else getattr(obj, attr)


def test_every_module_and_public_name_has_a_docstring():
    missing = []
    for module in _modules():
        if not (module.__doc__ or "").strip():
            missing.append(f"module {module.__name__}")
        for qualname, obj in _public(module):
            if not (inspect.getdoc(obj) or "").strip():
                missing.append(qualname)
    assert not missing, "public names without a docstring:\n  " + "\n  ".join(missing)


def _error_classes():
    from msrl.errors import MsrlError

    list(_modules())  # every class defined
    seen, todo = [], [MsrlError]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen and sub.__module__.startswith("msrl."):
                seen.append(sub)
                todo.append(sub)
    from msrl.run.outcome import TrainingInterrupted

    return [MsrlError, *seen, TrainingInterrupted]


def test_every_error_class_is_in_the_troubleshooting_guide_and_the_reference():
    guide = (DOCS / "guide" / "troubleshooting.md").read_text()
    reference = (DOCS / "reference" / "errors.md").read_text()
    classes = _error_classes()
    assert len(classes) > 30
    for cls in classes:
        assert f"`{cls.__name__}`" in guide, f"{cls.__module__}.{cls.__name__} is not in docs/guide/troubleshooting.md"
        path = f"{cls.__module__}.{cls.__qualname__}".replace("msrl.cluster.", "cluster.")
        assert f"::: {path}\n" in reference, f"{path} is not in docs/reference/errors.md"


def _nav_pages() -> list[str]:
    return re.findall(r"^\s*-\s*(?:[^:\n]+:\s*)?([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)


def test_every_algorithm_has_its_page_in_the_nav_with_a_row_of_the_benchmark_table():
    rows = set(re.findall(r'<a id="([\w-]+)"></a>', (ROOT / "bench" / "RESULTS.md").read_text()))
    nav = _nav_pages()
    algorithms = sorted(p.stem for p in (ROOT / "algorithms").glob("*.py") if p.stem != "__init__")
    assert "ppo" in algorithms and len(algorithms) >= 11
    for name in algorithms:
        page = DOCS / "algorithms" / f"{name}.md"
        assert page.is_file(), f"algorithms/{name}.py has no page docs/algorithms/{name}.md"
        assert f"algorithms/{name}.md" in nav, f"docs/algorithms/{name}.md is not in mkdocs.yml's nav"
        text = page.read_text()
        cited = re.findall(r"\.\./bench/RESULTS\.md#([\w-]+)", text)
        assert cited, f"docs/algorithms/{name}.md links no row of bench/RESULTS.md"
        assert set(cited) <= rows, f"docs/algorithms/{name}.md links rows {set(cited) - rows} that bench/RESULTS.md lacks"
        assert "## Current result" in text and "**Paper**" in text and f"::: algorithms.{name}." in text


def test_every_page_of_the_docs_is_in_the_nav():
    nav = set(_nav_pages())
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if not str(p.relative_to(DOCS)).startswith("bench/")}
    assert pages - nav == set(), f"pages no one can reach from the site's navigation: {sorted(pages - nav)}"


def test_the_benchmark_table_cites_no_superseded_section():
    table = (ROOT / "bench" / "RESULTS.md").read_text()
    results = ROOT / "bench" / "results"
    superseded = {}
    for page in results.glob("*.md"):
        for title, body in re.findall(r"^## (.+)\n\n(> \*\*Superseded\*\*[^\n]*)?", page.read_text(), re.M):
            if body:
                superseded[(page.name, title)] = True
    assert superseded, "the notebook marks superseded sections"
    cited = set(re.findall(r"\(results/([\w.]+)#([\w-]+)\)", table))
    assert cited
    for (name, title) in superseded:
        assert (name, slugify(title)) not in cited, f"bench/RESULTS.md cites a superseded section: {name}, {title}"
    for name, anchor in cited:
        titles = re.findall(r"^## (.+)$", (results / name).read_text(), re.M)
        assert anchor in {slugify(t) for t in titles}, f"bench/RESULTS.md cites {name}#{anchor}, which is not a section"


@pytest.mark.parametrize("page", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").glob("*.md")))
def test_each_notebook_page_is_newest_first(page):
    dates = re.findall(r"^## .*?(20\d\d-\d\d-\d\d)", (ROOT / page).read_text(), re.M)
    assert dates and dates == sorted(dates, reverse=True), dates


def test_the_algorithm_index_gives_each_algorithms_own_action_spaces():
    """docs/algorithms/index.md's "action spaces" column is what each ``ALGORITHM`` declares."""
    from msrl.registry import load_algorithm

    rows = re.findall(r"^\| \[[^\]]+\]\((\w+)\.md\) \| [^|]+ \| ([^|]+) \|", (DOCS / "algorithms" / "index.md").read_text(), re.M)
    assert len(rows) >= 14
    for name, spaces in rows:
        declared = {s.__name__ for s in load_algorithm(name).action_spaces}
        assert {s.strip() for s in spaces.split(",")} == declared, (name, spaces, declared)
