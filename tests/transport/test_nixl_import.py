"""Which NIXL module hkvsim imports (hkvsim.transport.nixl.nixl_api_candidates): the one backend
wheel installed, directly, so a rank process does not import torch only for the ``nixl`` meta
package to find that torch is a CPU build; the meta package wherever it has a choice to make."""

from __future__ import annotations

import sys

from hkvsim.transport import nixl as mod


def _installed(monkeypatch, *names: str) -> None:
    monkeypatch.setattr(mod, "installed_nixl_backends", lambda: names)


def test_one_backend_wheel_is_imported_directly_while_torch_is_not_loaded(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    _installed(monkeypatch, "nixl_cu12")
    assert mod.nixl_api_candidates() == ("nixl_cu12._api", "nixl._api")
    _installed(monkeypatch, "nixl_rocm")
    assert mod.nixl_api_candidates()[0] == "nixl_rocm._api"


def test_the_meta_package_chooses_when_torch_is_loaded_or_there_is_a_choice(monkeypatch) -> None:
    _installed(monkeypatch, "nixl_cu12", "nixl_cu13")  # the lab extra installs both
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert mod.nixl_api_candidates()[0] == "nixl._api"
    _installed(monkeypatch, "nixl_cu12")
    monkeypatch.setitem(sys.modules, "torch", object())  # a VRAM rank imports torch first
    assert mod.nixl_api_candidates()[0] == "nixl._api"
    _installed(monkeypatch)  # none: the meta package's own error says why
    assert mod.nixl_api_candidates()[0] == "nixl._api"
    # then each backend wheel once, the ROCm one too
    assert sorted(mod.nixl_api_candidates()[1:]) == sorted(
        f"{name}._api" for name in mod.NIXL_BACKEND_MODULES)


def test_installed_backends_are_found_without_importing_them(monkeypatch) -> None:
    found = {"nixl_cu12"}
    monkeypatch.setattr(mod.importlib.util, "find_spec",
                        lambda name: object() if name in found else None)
    assert mod.installed_nixl_backends() == ("nixl_cu12",)
    found.add("nixl_cu13")
    assert mod.installed_nixl_backends() == ("nixl_cu13", "nixl_cu12")
