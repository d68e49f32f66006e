"""The README stays a newcomer's page: its first screen says what ReKV is, gives the two set-up
commands and a ten-line functional-API example that runs, then the headline results; its SLURM
lines parse as the commands they start, one process a node; every
relative link in it, in docs/ and in results/ points at a file that exists; and the docs, which
are reference, hold no commit hash (one of this repository's commits, so checksums and other hex
runs are left alone)."""
import pathlib
import re
import shlex
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = sorted((ROOT / "results").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
HEX_RUN = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
SET_UP = ("pip install -e . && rekv handoff", "pip install -e '.[test]' && pytest")
EXAMPLE = "## The functional API in ten lines"
SERVING = "## Serving from Python"
HEADLINE = "## Headline results"


def _sections(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


def _example(text: str, heading: str = EXAMPLE) -> str:
    """The first python block after `heading`."""
    after = text[text.index(heading):]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_is_short_and_holds_the_two_set_up_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for command in SET_UP:
        assert command in text
    assert SET_UP[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_first_screen_is_what_rekv_is_set_up_and_an_example_then_the_headline():
    text = README.read_text()
    assert _sections(text)[:3] == ["## Set up", EXAMPLE, HEADLINE]
    intro, rest = text.split("## Set up", 1)
    assert "ReKV" in intro and len(intro.splitlines()) <= 12
    first_screen = text[:text.index(HEADLINE)]
    assert all(command in first_screen for command in SET_UP)
    assert len(first_screen.splitlines()) <= 50
    code = [line for line in _example(text).splitlines() if line.strip()]
    assert len(code) <= 10, code


def test_readme_example_runs():
    """The example asserts its own claim (the split equals a prefill bitwise)."""
    exec(compile(_example(README.read_text()), "README example", "exec"), {})


def test_readme_serving_example_runs():
    """The Python serving example, as a reader runs it: two worker processes on the shipped
    model; it asserts its own claim (streamed and generated tokens agree, the request served)."""
    code = _example(README.read_text(), SERVING)
    assert len([line for line in code.splitlines() if line.strip()]) <= 10
    exec(compile(code, "README serving example", "exec"), {})


def test_every_relative_link_resolves():
    broken = [f"{doc.relative_to(ROOT)}: {target}" for doc in DOCS + RESULTS
              for target in LINK.findall(doc.read_text())
              if "://" not in target and not (doc.parent / target).exists()]
    assert not broken, broken


def test_every_doc_is_linked_from_the_readme_and_every_results_page_from_its_index():
    linked = {(ROOT / t).resolve() for t in LINK.findall(README.read_text())}
    assert {d.resolve() for d in DOCS[1:]} | {ROOT / "results" / "README.md"} <= linked
    index = ROOT / "results" / "README.md"
    pages = {(index.parent / t).resolve() for t in LINK.findall(index.read_text())}
    assert {p.resolve() for p in RESULTS if p != index} <= pages


def repository_commits(root: pathlib.Path) -> list[str] | None:
    """Every commit of the repository at `root` (`git rev-list --all`); None without git or
    history."""
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-list", "--all"], capture_output=True,
                              text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.split() or None


def commit_hashes(text: str, commits: list[str] | None) -> list[str]:
    """The hex runs of 7-40 digits in `text` that name one of `commits` (a prefix of one);
    without the history, every run that holds a letter and a digit, as a commit's would."""
    runs = HEX_RUN.findall(text)
    if commits is None:
        return [r for r in runs if re.search("[a-f]", r) and re.search("[0-9]", r)]
    return [r for r in runs if any(c.startswith(r) for c in commits)]


def test_docs_hold_no_commit_hash():
    commits = repository_commits(ROOT)
    found = {str(doc.relative_to(ROOT)): hits for doc in DOCS
             if (hits := commit_hashes(doc.read_text(), commits))}
    assert not found, found


@pytest.mark.parametrize("with_history", [True, False])
def test_the_check_finds_a_planted_commit_hash(with_history):
    commits = repository_commits(ROOT) if with_history else None
    if with_history:
        planted = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        assert commits and planted in commits
    else:
        # Without history a run is taken for a commit when it holds a letter and a digit, so
        # the planted hash must hold both (HEAD's abbreviation may be letters alone).
        planted = "9fceb02d0ae598e95dc970b74767f19372d61af8"
    text = (f"measured at {planted[:7]}, see {planted}; the checksum 3f2a9c41 and the count "
            f"1256449 are not commits; nor is {planted[:6]} (too short) or x{planted[:7]} "
            f"(inside a word), nor the word defaced")
    expected = [planted[:7], planted] + ["3f2a9c41"] * (not with_history)
    assert commit_hashes(text, commits) == expected


def _slurm_block(command: str) -> list[str]:
    """The README's bash block that runs `rekv COMMAND` under srun, as lines (each line ending
    in a backslash joined with the next)."""
    blocks = [b.split("```", 1)[0] for b in README.read_text().split("```bash\n")[1:]]
    (block,) = [b for b in blocks if "srun" in b and f"rekv {command} " in b]
    return block.replace("\\\n", " ").splitlines()


def _srun_argv(line: str) -> tuple[list[str], list[str]]:
    """An srun line's own words, and the argv of the `rekv` it runs (inside `bash -c '...'`,
    each `$(...)` taken as its first `echo`'s word)."""
    words = shlex.split(line)
    if "bash" in words:
        inner = re.sub(r"\$\(.*?echo (\w+).*?\)", r"\1", words[words.index("-c") + 1])
        return words[:words.index("bash")], shlex.split(inner)[1:]
    return words[:words.index("rekv")], words[words.index("rekv") + 1:]


@pytest.mark.parametrize("command", ["handoff", "serve"])
def test_the_readme_slurm_lines_parse_and_start_one_process_a_node(command):
    """Its flags parse as `rekv COMMAND`'s, each node runs one process of the run (`serve`: the
    router and its workers), and the job's key is made alike for both."""
    from rekv_jax.cli.main import build_parser
    from rekv_jax.launch.nodes import node_names

    lines = _slurm_block(command)
    srun, argv = _srun_argv(next(line for line in lines if line.startswith("srun")))
    args = build_parser(command).parse_args(argv)
    nodes = int(srun[srun.index("-N") + 1])
    assert "--ntasks-per-node=1" in srun and args.secret_file == "~/rekv.key"
    if command == "serve":
        assert args.role == "auto"
        assert nodes == len(node_names(args.prefill_workers, args.decode_workers)) == 5
        assert (args.prefill_workers, args.decode_workers) == (2, 2)
    else:
        assert args.role in ("decode", "prefill") and nodes == 2
    assert lines[0].split("#")[0].strip() == _slurm_block("handoff")[0].split("#")[0].strip()
