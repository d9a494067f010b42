"""The README and docs/: the README stays a short page, every relative link between them
resolves (files and headings), docs/patches.md lists the registry's patches with their DeepSpeed
ranges, and neither they, the benchmark results' prose nor the code (every tracked Python, shell
and TOML file) speak of how the project was built (work periods, issue numbers, test-machine
labels): a result names its date, command, hardware and software instead.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from ds_z3native.compat.registry import all_patches

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_BYTES = 10_000

# Words of the project's own making-of, and labels of the machines it was measured on.
HISTORY = re.compile(r"\bissue\s*#?\d+|(?<![\w&#/])#\d+\b|\bsessions?\b|\bstop\s+#?\d+\b|"
                     r"\bwork periods?\b|\bGPU-[0-9a-f]{8}\b|\bnvidia-h200-x\d|\blending\b|\.gpu/|"
                     r"\bthe\s+(?:GPU|CPU|CUDA|test|build|remote)\s+(?:host|box|machine|node)\b",
                     re.I)
# Technical terms with one of those words, taken out before the check: torch's compile session
# (torch.compiler's flag and context), a POSIX session (a process group leader's) and pytest's
# Session object (a fixture's request.session).
TERMS = re.compile(r"\bcompile[-_ ]sessions?\b|_compile_session_context|\bsession of its own\b|"
                   r"\brequest\.session\b", re.I)
# Code files the check reads (git ls-files patterns), and extension-less scripts with a shebang.
CODE_PATTERNS = ("*.py", "*.sh", "*.toml")
# The file that holds the pattern and the examples it must catch.
SELF = Path(__file__).resolve()
# Result fields that are prose (the rest are measured values, e.g. gpu_conditions' device).
PROSE_FIELDS = ("note", "replaced_notes", "source")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> List[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)]


def _links(page: Path) -> Iterator[Tuple[str, Path, str]]:
    """(link, target file, anchor) of each relative link of ``page``, outside code blocks."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for match in LINK.finditer(text):
        link = match.group(1)
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto
        path, _, anchor = link.partition("#")
        yield link, (page.parent / path).resolve() if path else page, anchor


def test_readme_is_short_and_links_to_every_docs_page() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/"
    linked = {target for _, target, _ in _links(README)}
    assert DOCS and set(DOCS) <= linked, sorted(str(d) for d in set(DOCS) - linked)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link, target, anchor in _links(page):
        if not target.exists():
            broken.append(f"{link}: no {target}")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not broken, broken


def _range(first: Any, last: Any) -> str:
    if last is None:
        return f"{first} and later"
    return str(first) if first == last else f"{first} – {last}"


def test_patches_page_lists_the_registry_in_order() -> None:
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in (ROOT / "docs" / "patches.md").read_text().splitlines()
            if line.startswith("| `")]
    shown = [(row[0].strip("`"), row[1]) for row in rows]
    patches = all_patches()
    assert [name for name, _ in shown] == [p.name for p in patches]
    for (name, versions), patch in zip(shown, patches):
        assert versions.startswith(_range(patch.first, patch.last)), (name, versions)


def _prose(value: Any, key: str = "") -> Iterator[str]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _prose(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _prose(v, key)
    elif isinstance(value, str) and key in PROSE_FIELDS:
        yield value


def _history(text: str) -> List[str]:
    """The history words in ``text`` (technical terms that share a word excepted)."""
    return HISTORY.findall(TERMS.sub(" ", text))


def _tracked_code() -> List[Path]:
    """Every git-tracked Python, shell and TOML file, and every tracked script without an
    extension that starts with a shebang; this file excepted."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"not a git checkout: {out.stderr.strip()}")
    paths = []
    for name in filter(None, out.stdout.split("\0")):
        path = ROOT / name
        if path.resolve() == SELF or not path.is_file():
            continue
        if any(path.match(pattern) for pattern in CODE_PATTERNS):
            paths.append(path)
        elif not path.suffix and path.read_bytes()[:2] == b"#!":
            paths.append(path)
    return paths


def test_docs_and_results_speak_of_the_project_only() -> None:
    found: Dict[str, List[str]] = {}
    for page in PAGES:
        hits = _history(page.read_text())
        if hits:
            found[str(page.relative_to(ROOT))] = hits
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        hits = [h for text in _prose(json.loads(path.read_text())) for h in _history(text)]
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found


def test_code_speaks_of_the_project_only() -> None:
    paths = _tracked_code()
    names = {str(p.relative_to(ROOT)) for p in paths}
    # The kinds of file the check covers are all there (a pattern that matches nothing checks
    # nothing): a package module, a shell script, the TOML, an extension-less script.
    assert {"python/ds_z3native/settings.py", "scripts/run_tests.sh", "pyproject.toml",
            ".ci/run"} <= names, sorted(names)
    assert "tests/test_docs.py" not in names
    found: Dict[str, List[str]] = {}
    for path in paths:
        hits = _history(path.read_text(errors="replace"))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found


def test_the_history_check_catches_what_it_should() -> None:
    for text in ("as issue 5 asks", "in session 3", "at stop 12", "on GPU-28b808b3",
                 "an nvidia-h200-x2 host", "bash .gpu/run.sh", "# fixed for #20",
                 "# seen on the GPU host", "measured on the CPU machine", "this session's run",
                 "torch's compile session, as in session 2"):
        assert _history(text), text
    for text in ("no collective issued", "2026-12-01 on one H200 and 16 cores", "a GPU machine",
                 "#include <vector>", "${#need[@]}", "a, b = x[0], y  # 0-based", "&#20;",
                 "torch raises it for a whole compile session", "torch's compile-session flag",
                 'getattr(torch.compiler, "_compile_session_context", None)',
                 "torchrun starts each rank in a session of its own",
                 "for item in request.session.items"):
        assert not _history(text), text
    results = {"note": "on GPU-28b808b3", "runs": {"x": {"gpu_conditions": {
        "device": "GPU-28b808b3-99dd"}}}, "replaced_notes": ["fine"]}
    assert list(_prose(results)) == ["on GPU-28b808b3", "fine"]


# ---- Facts stated in more than one place -------------------------------------------------------
# A figure a new user reads (how long the demo or the build takes, how many patches install()
# applies, from which DeepSpeed release DeepCompile runs on the CPU, the demo's model sizes, the
# model types the suites train, the extras) is stated once, or checked here against every other
# place that states it and against the code it describes.

USER_PAGES = [README, ROOT / "docs" / "usage.md", ROOT / "docs" / "install.md"]
BENCH_BLOCK = re.compile(r"<!-- bench-summary:begin -->.*?<!-- bench-summary:end -->", re.S)
FENCE = re.compile(r"```.*?```", re.S)
# A duration: "17–19 s", "1.5 min", "30 minutes", "about half a minute", "a minute".
DURATION = re.compile(r"\b\d+(?:\.\d+)?(?:\s*[–-]\s*\d+(?:\.\d+)?)?\s*(?:s|secs?|seconds?|mins?|"
                      r"minutes?|h|hours?)\b|\b(?:half an? |an? )(?:minute|hour)\b")
# Where each fact is stated, and what a statement of it looks like (a sentence that matches).
DEMO_TIME = re.compile(r"\bdemo\b|\bdefault run\b", re.I)
BUILD_TIME = re.compile(r"\b(?:CPU|CUDA) flavour\b|\bpip install\b", re.I)
FACT_HOMES = {"the demo's run time": ("docs/usage.md", DEMO_TIME),
              "the build's time": ("docs/install.md", BUILD_TIME)}
NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty twenty-one twenty-two twenty-three "
    "twenty-four twenty-five".split())}
# The first DeepSpeed release whose CPU accelerator runs DeepCompile (0.19.3's eager-fallback
# getter breaks Dynamo's guard there); helpers.dc_runner and the demo gate on it.
DEEPCOMPILE_ON_CPU = "0.19.4"
# The suites that train DeepCompile + LoRA + non-reentrant checkpointing against eager ZeRO-3,
# as the README names them.
FAMILY_SUITES = {"CI on CPU": ("tests/test_deepcompile_cpu.py",
                               "tests/test_deepcompile_cpu_families.py"),
                 "GPU suite": ("tests/gpu/test_deepcompile_llama.py",
                               "tests/gpu/test_deepcompile_families_gpu.py")}


def _text(page: Path, code: bool = False) -> str:
    """``page``'s text without the generated results block and, unless ``code``, fenced code."""
    text = BENCH_BLOCK.sub(" ", page.read_text())
    return text if code else FENCE.sub(" ", text)


def _sentences(text: str) -> List[str]:
    """``text`` cut into sentences (and table rows), whitespace collapsed."""
    out = []
    for block in re.split(r"\n\s*\n|\n(?=\s*[|*-] )|\n(?=\s*\d+\. )", text):
        block = " ".join(block.split())
        out += [s for s in re.split(r"(?<=[.;!?])\s+(?=[A-Z`(*_])", block) if s]
    return out


def _python_prose(path: Path) -> str:
    """The comments and string literals of a Python file, each a paragraph of its own
    (consecutive comment lines and adjacent literals joined)."""
    import io
    import tokenize

    chunks: List[str] = []
    last = None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            continue
        if tok.type == tokenize.COMMENT:
            piece = tok.string.lstrip("#").strip()
        elif tok.type == tokenize.STRING:
            piece = re.sub(r"^[a-zA-Z]*('''|\"\"\"|'|\")|('''|\"\"\"|'|\")$", "", tok.string)
        else:
            last = None
            continue
        if last == tok.type:
            chunks[-1] += " " + piece
        else:
            chunks.append(piece)
        last = tok.type
    return "\n\n".join(chunks)


def _demo_help() -> str:
    """``ds-z3native demo --help``, as argparse prints it."""
    import contextlib
    import io

    from ds_z3native import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    return out.getvalue()


def _statements(pattern: "re.Pattern[str]", extra: Dict[str, str]) -> Dict[str, List[str]]:
    """The sentences with a duration that match ``pattern``, per page (README and docs/, outside
    fenced code and the results block) and per text of ``extra``."""
    texts = {str(p.relative_to(ROOT)): _text(p) for p in PAGES}
    texts.update(extra)
    found: Dict[str, List[str]] = {}
    for name, text in texts.items():
        hits = [s for s in _sentences(text) if pattern.search(s) and DURATION.search(s)]
        if hits:
            found[name] = hits
    return found


def test_the_readme_and_the_demo_help_state_no_durations() -> None:
    """How long something takes is stated in docs/, once: the README links there, and the demo's
    --help says nothing that could disagree with docs/usage.md."""
    readme = [s for s in _sentences(_text(README)) if DURATION.search(s)]
    assert not readme, readme
    help_text = " ".join(_demo_help().split()).replace("(default 600)", "")
    assert not DURATION.search(help_text), help_text


@pytest.mark.parametrize("fact", sorted(FACT_HOMES))
def test_a_duration_is_stated_once_in_its_page(fact: str) -> None:
    home, pattern = FACT_HOMES[fact]
    found = _statements(pattern, {"ds-z3native demo --help": _demo_help()})
    assert list(found) == [home] and len(found[home]) == 1, (fact, found)


SETTINGS_BLOCK = re.compile(
    r"<!-- settings-table:begin\b[^\n]*-->\n(.*?)\n<!-- settings-table:end -->", re.S)
REGENERATE_SETTINGS = ('python -c "from ds_z3native import settings; '
                       'print(settings.markdown_table())"')


def test_the_settings_table_is_the_settings_own() -> None:
    """docs/usage.md's table of the settings is what ``settings.markdown_table()`` writes from
    the fields of ``Settings`` (each field's doc, variable, values and default, stated there
    once); every setting is in it, and the page's other variable table names none of them."""
    from ds_z3native import settings

    usage = (ROOT / "docs" / "usage.md").read_text()
    blocks = SETTINGS_BLOCK.findall(usage)
    assert len(blocks) == 1, "docs/usage.md: one <!-- settings-table:begin --> ... end block"
    assert blocks[0].strip() == settings.markdown_table(), (
        "docs/usage.md's settings table differs from the settings' own; paste the output of\n"
        f"  {REGENERATE_SETTINGS}\nbetween its settings-table markers")
    outside = SETTINGS_BLOCK.sub(" ", usage)
    for field in dataclasses.fields(settings.Settings):
        variable = field.metadata["variable"]
        assert f"`{field.name}`" in blocks[0] and f"`{variable}`" in blocks[0], field.name
        rows = [ln for ln in outside.splitlines() if ln.startswith(f"| `{variable}")]
        assert not rows, f"docs/usage.md states {variable} outside the generated table: {rows}"


def test_every_patch_count_is_the_registrys_for_its_deepspeed() -> None:
    """A count of install()'s patches (the demo's sample output) is that of the DeepSpeed release
    stated beside it (in the same code block or line), and a sample's fix row is the demo's own
    grouping of those patches."""
    from packaging.version import Version

    from ds_z3native.compat.registry import patches_for
    from ds_z3native.demo import _fix_row

    checked = 0
    for page in PAGES:
        text = _text(page, code=True)
        for part in FENCE.findall(text) + FENCE.sub(" ", text).splitlines():
            counts = re.findall(r"\b(\d+) patch(?:es)?\b", part)
            if not counts:
                continue
            version = re.search(r"DeepSpeed\s+(?:/ torch\s+)?(\d+\.\d+\.\d+)", part)
            assert version, f"{page.name}: a patch count with no DeepSpeed release: {part!r}"
            names = [p.name for p in patches_for(Version(version.group(1)))]
            assert {int(c) for c in counts} == {len(names)}, (page.name, version.group(1),
                                                               counts, len(names))
            row = _fix_row("ds_z3native.install(): " + ", ".join(names))
            for shown in re.findall(r"^\s*fix\s+(ds_z3native\.install\(\), .*)$", part, re.M):
                assert shown == row, f"{page.name}: the sample's fix row\n{shown}\nis now\n{row}"
            checked += 1
    assert checked, "no patch count found: the demo's sample output in docs/usage.md has one"


def _deepcompile_cpu_releases(text: str) -> List[Tuple[str, str]]:
    """(release, sentence) of each sentence of ``text`` that says from which DeepSpeed release
    DeepCompile runs on the CPU (or before which it does not)."""
    out = []
    for sentence in _sentences(text):
        if "DeepCompile" not in sentence or not re.search(r"\bCPU\b", sentence):
            continue
        for m in re.finditer(r"(?:\bfrom|\bsince|>=|≥)\s*(?:DeepSpeed\s*)?(0\.\d+\.\d+)|"
                             r"(0\.\d+\.\d+)\s*(?:and later|or later|\+(?!\w))|"
                             r"\bbefore\s*(?:DeepSpeed\s*)?(0\.\d+\.\d+)", sentence):
            if m.group(3) and DEEPCOMPILE_ON_CPU in sentence:
                continue  # what stops the releases before it (a sentence that names it)
            out.append((m.group(1) or m.group(2) or m.group(3), sentence))
    return out


def _prose_sources() -> Dict[str, str]:
    """README, docs/ (less the patch table, whose ranges are the patches' own), the demo's --help,
    and the comments and strings of the package, the tests and the examples."""
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in PAGES}
    texts["docs/patches.md"] = "\n".join(ln for ln in texts["docs/patches.md"].splitlines()
                                         if not ln.startswith("| `"))
    texts["ds-z3native demo --help"] = _demo_help()
    for folder in ("python", "tests", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() != SELF:
                texts[str(path.relative_to(ROOT))] = _python_prose(path)
    return texts


def test_deepcompile_on_the_cpu_starts_at_one_release_everywhere() -> None:
    """Every statement of the first DeepSpeed release that runs DeepCompile on its CPU
    accelerator names the same release, the one the demo and the CPU tests gate on; and no
    sentence calls DeepCompile CUDA-only without naming it."""
    from ds_z3native import demo
    from helpers import dc_runner

    assert str(demo._DEEPCOMPILE_ON_CPU) == DEEPCOMPILE_ON_CPU
    assert f'Version("{DEEPCOMPILE_ON_CPU}")' in Path(dc_runner.__file__).read_text()
    wrong, found = [], 0
    for name, text in _prose_sources().items():
        for release, sentence in _deepcompile_cpu_releases(text):
            found += 1
            if release != DEEPCOMPILE_ON_CPU:
                wrong.append(f"{name}: {release}: {sentence[:200]}")
        for sentence in _sentences(text):
            if (re.search(r"DeepCompile(?: (?:itself|alone))? (?:needs|requires|runs on) CUDA\b|"
                          r"DeepCompile.*(?:CUDA[- ]only|only on CUDA)", sentence)
                    and not re.search(r"\b0\.\d+\.\d+\b", sentence)):
                wrong.append(f"{name}: CUDA only: {sentence[:200]}")
    assert found >= 5 and not wrong, "\n".join(wrong) or found


def test_the_deepcompile_cpu_release_check_catches_what_it_should() -> None:
    for text in ("DeepCompile runs on DeepSpeed's CPU accelerator from DeepSpeed 0.19.3.",
                 "DeepSpeed >= 0.19.3 runs DeepCompile on its CPU accelerator.",
                 "`--deepcompile` under DeepCompile (GPUs, or CPU ranks from DeepSpeed 0.19.3)",
                 "DeepCompile itself needs CUDA before 0.19.3; on the CPU it trains.",
                 "| 0.19.3 – 0.19.7 | release matrix (DeepCompile on CPU from 0.19.3) |"):
        assert [r for r, _ in _deepcompile_cpu_releases(text)] == ["0.19.3"], text
    for text in ("On DeepSpeed 0.19.3 and later the run succeeds without ds_z3native too.",
                 "known failure: DeepCompile on CPU on 0.19.3 (its eager-fallback getter)",
                 "DeepCompile on CPU (torch 2.13.0+cpu, DeepSpeed 0.19.8)",
                 "DeepCompile does not run on the CPU: before 0.19.3 its profiler needs CUDA, "
                 "and 0.19.4 changed the getter"):
        assert not _deepcompile_cpu_releases(text), text
    prose = _python_prose(SELF.parent / "helpers" / "dc_runner.py")
    assert "DeepCompile on the CPU runs from DeepSpeed 0.19.4" in " ".join(prose.split())


def _lora_llama_params(size: Any) -> int:
    """The params of the demo's model at ``size`` (ds_z3native.models.build_lora_llama): the
    Llama built on the meta device, plus PEFT LoRA's two matrices on each targeted linear."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ds_z3native.models import LORA_TARGETS

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**size.llama_kwargs()))
    lora = sum(size.lora_rank * (m.in_features + m.out_features)
               for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.split(".")[-1] in LORA_TARGETS)
    return sum(p.numel() for p in model.parameters()) + lora


def test_the_demo_model_sizes_are_the_models_the_demo_builds() -> None:
    """Each params figure beside a demo preset (docs/usage.md's option table and sample output,
    the demo's --help) is that preset's count, LoRA included, at the precision written; and the
    new user's pages call no model "1 B" (the benchmarks' 0.96 B Llama and the demo's `1b`
    preset are different models)."""
    from ds_z3native.models import MODEL_SIZES

    units = {"K": 1e3, "M": 1e6, "B": 1e9}
    counts = {name: _lora_llama_params(size) for name, size in MODEL_SIZES.items()}
    preset = re.compile(r"(?<![\w-])[`']?(" + "|".join(map(re.escape, MODEL_SIZES)) +
                        r")[`']?(?![\w-])")
    figure = re.compile(r"~?(\d+(?:\.(\d+))?) ([KMB]) params")
    texts = {"docs/usage.md": _text(ROOT / "docs" / "usage.md", code=True),
             "ds-z3native demo --help": " ".join(_demo_help().split())}
    checked, wrong = set(), []
    for name, text in texts.items():
        for part in re.split(r"[;|\n]|\.\s", text):
            named, stated = preset.findall(part), figure.search(part)
            if not stated or len(set(named)) != 1:
                continue
            digits = len(stated.group(2) or "")
            expected = round(counts[named[0]] / units[stated.group(3)], digits)
            if float(stated.group(1)) != expected:
                wrong.append(f"{name}: {named[0]}: {stated.group(0)}, the model has "
                             f"{counts[named[0]]:,} ({expected} {stated.group(3)})")
            checked.add((name, named[0]))
    assert not wrong, wrong
    assert {("docs/usage.md", "1b"), ("ds-z3native demo --help", "1b"),
            ("docs/usage.md", "small")} <= checked, checked
    bare = {str(p.relative_to(ROOT)): re.findall(r".{30}\b1 ?B\b.{20}", _text(p, code=True))
            for p in USER_PAGES}
    bare["ds-z3native demo --help"] = re.findall(r"\b1 ?B\b", " ".join(_demo_help().split()))
    assert not any(bare.values()), bare


def _suite_families(path: Path) -> List[str]:
    """The model types a DeepCompile suite file trains: the values it passes to the runner's
    ``--family`` (literals, or a ``family`` parametrization), else Llama, the runner's default,
    where it runs ``--model llama`` with non-reentrant checkpointing."""
    tree = ast.parse(path.read_text())
    constants = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
    found: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "parametrize":
            if isinstance(node.args[0], ast.Constant) and node.args[0].value == "family":
                values = node.args[1]
                if isinstance(values, ast.Name):
                    values = constants[values.id]
                found += [v for v in ast.literal_eval(values) if v not in found]
        elif isinstance(node, (ast.Tuple, ast.List)):
            items = node.elts
            for i, item in enumerate(items[:-1]):
                nxt = items[i + 1]
                if (isinstance(item, ast.Constant) and item.value == "--family"
                        and isinstance(nxt, ast.Constant) and nxt.value not in found):
                    found.append(nxt.value)
    text = path.read_text()
    if not found and '"--model", "llama"' in text and '"non-reentrant"' in text:
        found = ["llama"]
    return found


def _families_phrase(suites: Dict[str, List[str]]) -> str:
    """The README's list of the model types the suites train, each group marked with its
    suites: "`llama`, `gpt2` (CI on CPU, GPU suite) and `mixtral` (GPU suite)"."""
    order: List[str] = []
    for families in suites.values():
        order += [f for f in families if f not in order]
    groups: Dict[Tuple[str, ...], List[str]] = {}
    for family in order:
        key = tuple(s for s in suites if family in suites[s])
        groups.setdefault(key, []).append(family)
    parts = [", ".join(f"`{f}`" for f in families) + f" ({', '.join(key)})"
             for key, families in sorted(groups.items(), key=lambda kv: -len(kv[0]))]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _model_family_rows() -> int:
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text.split("\n## Model families\n", 1)[1].split("\n## ", 1)[0]
    return len([ln for ln in section.splitlines() if ln.startswith("| `")])


def test_the_readme_names_the_model_types_the_suites_train() -> None:
    """The README's model types are those the DeepCompile suites train (CI on the CPU, the GPU
    suite), each marked with its suites; its count of the model types run by hand is the number
    of rows of docs/testing.md's table, as that page's own count is."""
    suites = {name: [f for path in paths for f in _suite_families(ROOT / path)]
              for name, paths in FAMILY_SUITES.items()}
    assert all(suites.values()) and "llama" in suites["CI on CPU"], suites
    phrase = _families_phrase(suites)
    readme = " ".join(_text(README).split())
    assert phrase in readme, f"the README should name {phrase}"
    rows = _model_family_rows()
    by_hand = re.search(r"([\w-]+) model types once by hand", readme)
    testing = re.search(r"on ([\w-]+) transformers model types",
                        " ".join((ROOT / "docs" / "testing.md").read_text().split()))
    assert by_hand and testing, (by_hand, testing)
    assert [NUMBER_WORDS.get(m.group(1), m.group(1)) for m in (by_hand, testing)] == [rows, rows]


def test_the_families_check_reads_the_suites_as_they_run() -> None:
    assert _families_phrase({"CI on CPU": ["llama", "gpt2"], "GPU suite": ["llama", "mixtral"]}) \
        == "`llama` (CI on CPU, GPU suite), `gpt2` (CI on CPU) and `mixtral` (GPU suite)"
    assert _suite_families(ROOT / "tests" / "gpu" / "test_deepcompile_families_gpu.py")[:1] == \
        ["gpt2"]


def _requirement_names(requirements: List[str]) -> List[str]:
    return [re.split(r"[<>=!~\[ ;]", r, 1)[0].lower() for r in requirements]


def _setup_extras() -> Dict[str, List[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for kw in node.keywords:
                if kw.arg == "extras_require":
                    return ast.literal_eval(kw.value)
    raise AssertionError("setup.py: no extras_require")


def test_the_pages_name_the_extras_setup_py_has() -> None:
    """docs/usage.md's table of what each command needs names every extra of setup.py and no
    other; docs/install.md's list says what each extra adds, every package of it."""
    extras = _setup_extras()
    usage = (ROOT / "docs" / "usage.md").read_text()
    heading = "\n## What to install for each command\n"
    assert heading in usage, f"docs/usage.md: no section{heading}"
    table = usage.split(heading, 1)[1].split("\n## ", 1)[0]
    named = {m for row in table.splitlines() if row.startswith("| ") and "---" not in row
             for m in re.findall(r"`(\w+)`", row.rsplit("|", 2)[-2])}
    assert named == set(extras), (sorted(named), sorted(extras))
    install = " ".join((ROOT / "docs" / "install.md").read_text().split())
    listing = re.search(r"Extras: (.*?)\.(?: -|$| \S+ )", install)
    assert listing, "docs/install.md: no Extras list"
    clauses = {m.group(1): m.group(2) for m in
               re.finditer(r"`(\w+)`(?: \([^)]*\))? adds (.*?)(?=;|$)", listing.group(1))}
    assert set(clauses) == set(extras), (sorted(clauses), sorted(extras))
    missing = {extra: [n for n in _requirement_names(reqs) if n not in clauses[extra].lower()]
               for extra, reqs in extras.items()}
    assert not any(missing.values()), missing


def test_the_examples_extra_brings_what_the_example_imports() -> None:
    """Every package examples/sft_lora.py imports (the TRL, accelerate, datasets and QLoRA paths
    included) is in the ``examples`` extra or installed by one of its packages."""
    import importlib.metadata as md
    import sys

    from packaging.requirements import Requirement

    if not hasattr(sys, "stdlib_module_names"):
        pytest.skip("Python < 3.10: no list of the standard library's modules")
    tree = ast.parse((ROOT / "examples" / "sft_lora.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module}
    third_party = sorted(imported - set(sys.stdlib_module_names) - {"torch", "ds_z3native"})
    assert {"trl", "datasets", "accelerate"} <= set(third_party), third_party
    wanted = _requirement_names(_setup_extras()["examples"])
    covered, todo = set(), list(wanted)
    while todo:  # the extra's packages and what they require, as installed here
        name = todo.pop().lower().replace("_", "-")
        if name in covered:
            continue
        covered.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for req in map(Requirement, requires):
            if not (req.marker and "extra" in str(req.marker)):
                todo.append(req.name)
    distributions = md.packages_distributions()
    missing = []
    for module in third_party:
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not dists & covered:
            missing.append(f"{module} ({', '.join(sorted(dists))})")
    assert not missing, f"examples/sft_lora.py imports what the examples extra lacks: {missing}"
