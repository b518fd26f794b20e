"""Every relative link in README.md, CHANGELOG.md and docs/*.md points at a file that exists, and a link to a
heading of a Markdown page (``page.md#heading``) at a heading that exists."""

import glob
import os
import re

ROOT = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", ".."))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages():
    pages = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    changelog = os.path.join(ROOT, "CHANGELOG.md")
    return pages + ([changelog] if os.path.exists(changelog) else [])


def _anchors(path):
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    heads = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", open(path).read(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_every_relative_link_resolves():
    broken, seen = [], 0
    for page in _pages():
        text = re.sub(r"```.*?```", "", open(page).read(), flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            seen += 1
            path = os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target}")
            elif "#" in target and path.endswith(".md") and target.split("#", 1)[1] not in _anchors(path):
                broken.append(f"{os.path.relpath(page, ROOT)}: {target} (no such heading)")
    assert seen > 50
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_readme_stays_short_and_the_suite_time_is_stated_once():
    """The suite's size and time live in docs/development.md alone; the README links there."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert len(readme.splitlines()) <= 200  # details live in docs/ and docs/results.md
    assert "docs/development.md#suite-time" in readme
    figure = re.compile(r"\d[\d,]* tests in \d+ min \d+ s")
    development = os.path.join(ROOT, "docs", "development.md")
    assert re.search(r"\*\*\d[\d,]* tests in \d+ min \d+ s\*\*", open(development).read())
    elsewhere = [os.path.relpath(p, ROOT) for p in _pages() if p != development and figure.search(open(p).read())]
    assert not elsewhere, f"the suite time copied outside docs/development.md: {elsewhere}"
