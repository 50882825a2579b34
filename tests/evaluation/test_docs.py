"""The docs stay true: every relative link of README.md and docs/*.md resolves inside the repository (to a
file, and a #fragment to one of its headings), docs/methods.md holds the registry's tables, and the pages
stay readable (README.md ≤ 200 lines, experiments/README.md an index ≤ 40 KB, a README in every experiment
folder). docs/extending.md's code is run by tests/decoding/test_registry.py, the README's decode example here."""

import pathlib
import re

from specdec import decoding
from tests import doc_examples

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
         *sorted((REPO_ROOT / "experiments").glob("**/README.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
GENERATED = re.compile(r"<!-- generated: decoding.methods.markdown\(\) -->\n(.*?)<!-- end generated -->", re.DOTALL)


def anchors(path: pathlib.Path) -> set[str]:
  """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
  seen, result = {}, set()
  for line in FENCE.sub("", path.read_text()).splitlines():
    heading = re.match(r"#{1,6} (.*)", line)
    if not heading:
      continue
    slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower().replace("`", "")).replace(" ", "-")
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    result.add(slug if count == 0 else f"{slug}-{count}")
  return result


def link_problems(page: pathlib.Path) -> list[str]:
  found = []
  for target in LINK.findall(FENCE.sub("", page.read_text())):
    where = f"{page.relative_to(REPO_ROOT)}: ({target})"
    if re.match(r"[a-z][a-z0-9+.-]*:", target):
      found.append(f"{where} leaves the repository")
      continue
    file, _, fragment = target.partition("#")
    path = (page.parent / file).resolve() if file else page
    if REPO_ROOT not in path.parents:
      found.append(f"{where} leaves the repository")
    elif not path.exists():
      found.append(f"{where} names no file")
    elif fragment and path.suffix == ".md" and fragment not in anchors(path):
      found.append(f"{where} names no heading of {path.relative_to(REPO_ROOT)}")
  return found


def test_link_checker_catches_each_kind_of_bad_link(tmp_path, monkeypatch):
  monkeypatch.setattr(f"{__name__}.REPO_ROOT", tmp_path)
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "a.md").write_text("# Title\n## Some `code` here\n")
  page = tmp_path / "README.md"
  page.write_text("[ok](docs/a.md#some-code-here) [web](https://x.org) [up](../elsewhere.md) "
                  "[none](docs/b.md) [anchor](docs/a.md#nothing)\n```\n[in code](nowhere.md)\n```\n")
  problems = link_problems(page)
  assert [p.split(") ")[1] for p in problems] == ["leaves the repository", "leaves the repository",
                                                   "names no file", "names no heading of docs/a.md"]


def test_every_link_of_the_docs_resolves():
  problems = [problem for page in PAGES for problem in link_problems(page)]
  assert not problems, "\n".join(problems)


def test_the_methods_page_holds_the_registrys_tables():
  (tables,) = GENERATED.findall((REPO_ROOT / "docs" / "methods.md").read_text())
  assert tables == decoding.methods.markdown(), (
      "docs/methods.md differs from the registry: replace the part between its 'generated' markers with the "
      "output of `python -c \"from specdec import decoding; print(decoding.methods.markdown(), end='')\"`")


def test_generates_docstring_lists_every_method_with_its_parameters():
  doc = decoding.generate.__doc__
  for method in decoding.METHODS.values():
    entry = re.search(rf"^    {method.name} +(.*)$", doc, re.MULTILINE)
    assert entry, method.name
    for param in method.params:
      assert f"{param.name} [{param.default!r}]" in doc


def test_the_pages_stay_short_and_every_experiment_has_its_readme():
  assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 200
  assert (REPO_ROOT / "experiments" / "README.md").stat().st_size <= 40_000
  folders = [p for p in (REPO_ROOT / "experiments").iterdir() if p.is_dir()]
  assert folders and all((folder / "README.md").exists() for folder in folders)


def test_the_readmes_decode_example_runs(capsys):
  namespace = doc_examples.load("README.md")
  out = namespace["out"]
  assert out.tokens.shape == (1, 32) and 0 < int(out.lengths[0]) <= 32
  assert capsys.readouterr().out.strip()   # the decoded text and the acceptance rate
