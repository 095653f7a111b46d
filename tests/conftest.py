import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets its own cache directory unless it sets one itself."""
    monkeypatch.setenv("PTXC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.delenv("PTXAS", raising=False)


@pytest.fixture(scope="session")
def toolchain():
    """ptxas is a hard requirement of the test suite (`make test` installs it)."""
    from ptxc.ptxas import toolchain as tc
    return tc()


def write_spec(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p
