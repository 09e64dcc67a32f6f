"""The commands of README.md, docs/ and the results page are each run by a test or taken from a
tested place, and every relative link of the Markdown pages leads to a file and heading.

A block of shell in those pages (```bash, ```sh, ```shell, ```console, or a fence with no
language) says where it is tested by an HTML comment on the line just above it, which GitHub does
not show. `<!-- from FILE ... -->`: each command is a command of a recipe (FILE is an
examples/*/README.md that tests/test_recipes.py runs; the recipe's $VARIABLES stand for any word,
the same one each time) or, for FILE `Makefile`, a `make TARGET`. `<!-- tested -->`: this file
runs the block, its tools made tiny as TINY says. `<!-- run by FILE -->`: another test, or the
Makefile, reads the page's blocks and runs them (FILE must name the page).
`<!-- template: why -->`: a command to adapt that no test can run (a GPU's, say); at most
MAX_TEMPLATES of them. Output, BibTeX and the like go in blocks labelled ```text or ```bibtex,
which take no marker. So a README command that drifts from its recipe fails here, and so does a
new command that nothing runs.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from helpers import ENV, PLUGIN
from pages import REPO, Block, fenced_blocks
from recipes import RECIPES, bash_blocks

import recipe_shims

DOCS = sorted((REPO / "docs").rglob("*.md"))
COMMAND_PAGES = [REPO / "README.md", *DOCS, REPO / "examples" / "results" / "README.md"]
LINKING_PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *DOCS, *sorted((REPO / "examples").rglob("*.md"))]
MAX_TEMPLATES = 3
# what a `tested` block's tools get (tests/recipe_shims.py applies it): the benchmark's tiny preset, on the CPU
TINY = {"feedback-benchmark": {"set": {"--device": "cpu"}, "add": ["--preset", "tiny"]}}
# the header rows of a tool's tables: shown in a ```text block after a tested block, the tiny run must print them
TABLE_HEADERS = ("model ", "operator ")


def shell_blocks(marker=None) -> List[Block]:
    found = [b for page in COMMAND_PAGES for b in fenced_blocks(page) if b.is_shell]
    return [b for b in found if marker is None or re.match(rf"{marker}\b", b.marker)]


def commands(script: str) -> List[str]:
    """A script's commands, one per statement (continued lines joined, an array assignment whole), as
    its words (shell quoting removed) joined by single spaces; comments dropped."""
    found, statement = [], ""
    for line in script.splitlines():
        statement += line
        if statement.endswith("\\"):
            statement = statement[:-1] + " "
            continue
        if re.match(r"\s*\w+=\(", statement) and not statement.rstrip().endswith(")"):
            statement += " "
            continue
        words = shlex.split(statement, comments=True)
        if words:
            found.append(" ".join(words))
        statement = ""
    return found


VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def is_instance(command: str, of: str) -> bool:
    """Whether `command` is the recipe's command `of` with each $VARIABLE replaced by a word."""
    pattern, seen, start = "", set(), 0
    for m in VARIABLE.finditer(of):
        name = "v_" + (m.group(1) or m.group(2))
        pattern += re.escape(of[start:m.start()]) + (f"(?P={name})" if name in seen else f"(?P<{name}>\\S+?)")
        seen.add(name)
        start = m.end()
    return re.fullmatch(pattern + re.escape(of[start:]), command) is not None


def makefile_targets() -> set:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), flags=re.M))


def recipe_commands(source: str) -> List[str]:
    """The commands of a recipe that tests/test_recipes.py runs."""
    name = re.fullmatch(r"examples/(\w+)/README\.md", source)
    assert name and name.group(1) in RECIPES, f"{source} is not a recipe that tests/test_recipes.py runs"
    return [c for block in bash_blocks(REPO / source) for c in commands(block)]


def untaken(block: Block) -> List[str]:
    """The commands of a `from` block that none of its sources holds."""
    sources = block.marker.split()[1:]
    assert sources, f"{block}: `from` names no file"
    taken = []
    for source in sources:
        if source == "Makefile":
            targets = makefile_targets()
            taken.append(lambda c: c.split()[0] == "make" and len(c.split()) > 1 and all(
                w in targets or re.fullmatch(r"[A-Z_]+=\S*", w) for w in c.split()[1:]))
        else:
            recipe = recipe_commands(source)
            taken.append(lambda c, recipe=recipe: any(is_instance(c, of) for of in recipe))
    return [c for c in commands(block.text) if not any(t(c) for t in taken)]


# ------------------------------------------------------------------------------ the markers


def test_every_shell_block_says_where_it_is_tested():
    unmarked = [f"{b}: ```{b.language}" for b in shell_blocks()
                if not re.fullmatch(r"from( \S+)+|tested|run by \S+|template: \S.*", b.marker)]
    assert not unmarked, ("shell blocks with no marker (<!-- from FILE -->, <!-- tested -->, <!-- run by FILE --> or "
                          f"<!-- template: why --> on the line above; output goes in ```text): {unmarked}")


def test_a_block_run_elsewhere_names_what_runs_it():
    """`run by FILE`: FILE exists and reads this page (names its path)."""
    for block in shell_blocks("run by"):
        runner = REPO / block.marker.split()[2]
        page = str(block.page.relative_to(REPO))
        assert runner.is_file() and page in runner.read_text(), f"{block}: {runner} does not read {page}"


def test_the_pages_hide_no_command_in_an_indented_block():
    """An indented code block would escape the markers: commands go in fences."""
    found = []
    for page in COMMAND_PAGES:
        fenced, previous = False, ""
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip().startswith("```"):
                fenced = not fenced
            elif not fenced and not previous.strip() and re.match(r"( {4}|\t)\S", line):
                found.append(f"{page.relative_to(REPO)}:{n}")
            previous = line
    assert not found, f"indented code blocks (use a fence with a language): {found}"


def test_templates_are_few():
    templates = shell_blocks("template")
    assert len(templates) <= MAX_TEMPLATES, f"more templates than {MAX_TEMPLATES}: {list(map(str, templates))}"


def test_a_block_taken_from_a_recipe_is_the_recipes():
    """Each command is one the recipe runs (its variables filled in): none with other options."""
    drifted = {str(b): untaken(b) for b in shell_blocks("from")}
    assert shell_blocks("from") and not any(drifted.values()), \
        f"commands that their recipe does not hold (copy them from it again): {drifted}"


def test_the_readme_gives_the_recipes_commands_not_others():
    """The README's training and evaluation commands are those of tested recipes."""
    readme = [b for b in fenced_blocks(REPO / "README.md") if b.is_shell]
    trains = [c for b in readme for c in commands(b.text) if c.split()[0] in ("fairseq-train", "fairseq-eval-lm",
                                                                             "fairseq-generate")]
    assert trains and all(b.marker.startswith("from examples/") for b in readme
                          if any(c in trains for c in commands(b.text)))


def test_the_matching_fills_variables_and_nothing_else():
    recipe = "fairseq-generate data --path $SAVE/checkpoint_best.pt --lenpen $LENPEN > $SAVE/test.out"
    assert is_instance("fairseq-generate data --path a/checkpoint_best.pt --lenpen 1.0 > a/test.out", recipe)
    assert not is_instance("fairseq-generate data --path a/checkpoint_best.pt --lenpen 1.0 > b/test.out", recipe)
    assert not is_instance("fairseq-generate data --path a/checkpoint_best.pt --lenpen 1.0 --beam 4 > a/test.out",
                           recipe)
    array = commands('fairseq-train "${TRAIN_ARGS[@]}" \\\n    --arch x')[0]
    assert is_instance(array, array) and not is_instance("fairseq-train data --arch x", array)
    assert commands("A=(a --b '(0.9,0.98)'\n    --c)\nmake demo  # comment\n") == ["A=(a --b (0.9,0.98) --c)",
                                                                                    "make demo"]


def shown_headers(block: Block) -> List[str]:
    """The table headers of the output shown after a tested block (its ```text blocks, up to the next shell)."""
    after = [b for b in fenced_blocks(block.page) if b.line > block.line]
    shown = []
    for b in after:
        if b.is_shell:
            break
        if b.language == "text":
            shown += [" ".join(line.split()) for line in b.text.splitlines() if line.startswith(TABLE_HEADERS)]
    return shown


@pytest.mark.slow  # the block's shell starts each tool as a process
@pytest.mark.parametrize("block", shell_blocks("tested"), ids=str)
def test_a_tested_block_runs_at_tiny_sizes(block, tmp_path):
    tools = {c.split()[0] for c in commands(block.text)}
    assert tools <= set(TINY), f"{block}: give {tools - set(TINY)} tiny sizes in TINY"
    recipe_shims.write(tmp_path / "bin")
    (tmp_path / "fairseq_feedback").symlink_to(PLUGIN, target_is_directory=True)
    env = dict(ENV, PATH=f"{tmp_path / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               RECIPE_OVERRIDES=json.dumps(TINY), RECIPE_CALLS=str(tmp_path / "calls.jsonl"))
    proc = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block.text], cwd=tmp_path, env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, f"{block} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    calls = (tmp_path / "calls.jsonl").read_text().splitlines()
    assert len(calls) == len(commands(block.text))  # each through its stand-in, made tiny
    printed = {" ".join(line.split()) for line in proc.stdout.splitlines()}
    missing = [h for h in shown_headers(block) if h not in printed]
    assert not missing, f"{block}: the output shown after it has columns the tool no longer prints: {missing}"


# ------------------------------------------------------------------------------ the README


def test_the_readme_reads_in_five_minutes():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200, "the depth goes in docs/"


def test_the_readme_links_every_recipe():
    readme = (REPO / "README.md").read_text()
    recipes = sorted(p.parent.name for p in (REPO / "examples").glob("*/README.md") if p.parent.name != "results")
    assert [r for r in recipes if f"(examples/{r}/README.md)" not in readme] == []


def test_the_architecture_page_draws_the_loop_package_as_its_docstring_does():
    import fairseq_feedback.loop

    drawing = fairseq_feedback.loop.__doc__.split("\n\n")[1]
    page = [b.text for b in fenced_blocks(REPO / "docs" / "architecture.md") if "FeedbackDecoder" in b.text]
    assert [" ".join(p.split()) for p in page] == [" ".join(drawing.split())], \
        "copy the drawing of fairseq_feedback/loop/__init__.py into docs/architecture.md"


# ------------------------------------------------------------------------------ links


def anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered."""
    text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = 0
        while (slug if n == 0 else f"{slug}-{n}") in found:
            n += 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(page: Path) -> List[str]:
    """The targets of a page's inline links and images and of its link definitions, code left out."""
    text = re.sub(r"^\s*```.*?^\s*```", "", page.read_text(encoding="utf-8"), flags=re.M | re.S)
    text = re.sub(r"`[^`]*`", "", text)
    return re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text) + \
        re.findall(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", text, flags=re.M)


def broken(page: Path) -> List[str]:
    found = []
    for target in links(page):
        if re.match(r"[a-zA-Z][\w+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if REPO not in (resolved, *resolved.parents) or not resolved.exists():
            found.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            found.append(f"{target} (no such heading)")
    return found


def test_the_anchors_are_githubs():
    page = REPO / "docs" / "gpu.md"
    assert {"on-a-gpu-cuda-graphs", "what-the-graphs-guarantee", "the-benchmark-on-a-gpu"} <= anchors(page)
    assert "2-train" in anchors(REPO / "examples" / "iwslt14_de_en" / "README.md")


@pytest.mark.parametrize("page", LINKING_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file_and_heading_of_the_repository(page):
    assert broken(page) == []
