"""The registry of rule codes (`fsdp_bridge/codemods/rules.py`) against the sources that emit them.

Codes must be distinct and documented; no source may emit a code as a bare string or mention
one the registry lacks; every registered code must be emitted somewhere (a registered code no
code path reports is a stale promise in the docs).
"""

import io
import pathlib
import re
import tokenize

from fsdp_bridge.codemods import rules

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_bridge"
# Where codes are emitted or read: the codemods and the migration driver/CLI around them.
EMITTERS = sorted((PACKAGE / "codemods").glob("*.py")) + sorted((PACKAGE / "migrate").glob("*.py"))
REGISTRY = PACKAGE / "codemods" / "rules.py"
CODE = re.compile(r"\bFB\d{3}\b")


def _constants() -> dict[str, str]:
    """Constant name -> code, for the registry's module-level constants."""
    codes = {rule.code for rule in rules.TABLE}
    return {name: value for name, value in vars(rules).items()
            if name.isupper() and isinstance(value, str) and value in codes}


def test_codes_are_distinct_and_well_formed():
    codes = [rule.code for rule in rules.TABLE]
    assert len(codes) == len(set(codes)), sorted(code for code in codes if codes.count(code) > 1)
    assert all(re.fullmatch(r"FB\d{3}", code) for code in codes), codes
    assert set(rules.BY_CODE) == set(codes)
    # One constant per code, so emitters cannot drift apart on two names for one rule.
    assert sorted(_constants().values()) == sorted(codes)


def test_every_code_is_documented():
    known = {rules.BRIDGE, rules.FSDP2, rules.YAFSDP, rules.DRIVER}
    for rule in rules.TABLE:
        assert rule.title.strip() and len(rule.doc.split()) >= 5, rule
        assert rule.emitted_by and set(rule.emitted_by) <= known, rule


def test_no_source_emits_a_bare_code():
    for path in EMITTERS:
        if path == REGISTRY:
            continue
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        bare = [t.start[0] for t in tokens if t.type == tokenize.STRING and CODE.fullmatch(t.string.strip("'\""))]
        assert not bare, f"{path.relative_to(ROOT)} lines {bare}: use the constant from codemods/rules.py"


def test_every_code_mentioned_is_registered():
    sources = [*EMITTERS, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for path in sources:
        unknown = set(CODE.findall(path.read_text())) - set(rules.BY_CODE)
        assert not unknown, f"{path.relative_to(ROOT)} mentions unregistered codes {sorted(unknown)}"


def test_every_registered_code_is_emitted():
    text = "\n".join(path.read_text() for path in EMITTERS if path != REGISTRY)
    unused = [f"{name} ({code})" for name, code in _constants().items() if f"rules.{name}" not in text]
    assert not unused, f"registered but emitted nowhere: {unused}"
