"""Stack fingerprint: stable for one node, different for a node that runs something else."""

from __future__ import annotations

import platform
import sys

import pytest

from gridwatch.agent.stack import OVERRIDE_ENV, fingerprint
from tests import fake_pynvml


def test_fingerprint_names_the_stack_and_hashes_stably(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    fp = fingerprint(nvml=False)
    assert fp.kernel == platform.release() and fp.python == platform.python_version()
    assert "msgspec" not in fp.packages and "torch" in fp.packages and "gridwatch" in fp.packages
    assert len(fp.hash) == 64 and fingerprint(nvml=False).hash == fp.hash
    assert "msgspec" in fingerprint(["msgspec"], nvml=False).packages


def test_override_makes_one_node_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    base = fingerprint(nvml=False)
    monkeypatch.setenv(OVERRIDE_ENV, "torch=2.12.0, driver=535.104.05, bogus, newpkg=1.0")
    odd = fingerprint(nvml=False)
    assert odd.packages["torch"] == "2.12.0" and odd.driver == "535.104.05" and odd.packages["newpkg"] == "1.0"
    assert odd.hash != base.hash
    monkeypatch.setenv(OVERRIDE_ENV, f"torch={base.packages['torch']}")
    assert fingerprint(nvml=False).hash == base.hash


def test_driver_and_cuda_come_from_nvml_when_there_is_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    state = fake_pynvml.install(monkeypatch, 1)
    fp = fingerprint()
    assert (fp.driver, fp.cuda) == ("550.54.15", "12.4")
    assert not state.initialised  # left as found
    state.driver = False
    assert fingerprint().driver is None


def test_fingerprint_does_not_import_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    fingerprint(nvml=False)
    assert "torch" not in sys.modules
