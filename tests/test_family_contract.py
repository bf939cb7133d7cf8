"""Every registered kernel family satisfies the family contract (``bagf_torch.kernels.family``): the required
members with the types and call signatures the compiler, the tuner and the cache rely on, and the optional hooks
it defines with the signatures their callers use. Also: every hook the package looks up by name is in the
contract, so a new lookup cannot go undocumented."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

import bagf_torch
from bagf_torch.kernels import FAMILIES, OPTIONAL, REQUIRED, FamilyHooks, KernelFamily, LaunchGeometry
from bagf_torch.problem import ConvProblem

DATA_TYPES = {"FAMILY": str, "SOURCE": str, "KERNEL": str, "MIN_ARCH": int, "PARAMS": Mapping, "DEFAULT": Mapping,
              "LEGACY": Mapping, "TEMPLATE_ORDER": tuple, "FORMATS": tuple, "KERNEL_ARGS": str, "LIBRARY": str,
              "TF32_PRODUCTS": bool}
"""The runtime type of each data member of the two protocols."""

PROBLEMS = (ConvProblem(n=8, c=192, h=13, w=13, k=384, r=3, s=3, padding=(1, 1)),
            ConvProblem(n=1, c=3, h=224, w=224, k=64, r=11, s=11, stride=(4, 4), padding=(2, 2)))
"""A 3x3 stride-1 layer (every family applies) and AlexNet's conv1 (not the Winograd ones)."""


def _test_family():
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        return importlib.import_module("faulty_family")  # the fault matrix's family, compiled by the GPU tests
    finally:
        sys.path.pop(0)


def _signature_problem(fn, ref) -> str | None:
    """None when ``fn`` accepts every call the protocol method ``ref`` allows: each count of positional
    arguments from its required ones to all of them, and each of its keyword-only arguments that ``fn`` has."""
    params = list(inspect.signature(ref).parameters.values())[1:]  # the protocol's self
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    sig = inspect.signature(fn)
    calls = [(tuple(range(k)), {}) for k in range(required, len(positional) + 1)]
    calls += [(tuple(range(len(positional))), {p.name: 0}) for p in params
              if p.kind is p.KEYWORD_ONLY and p.name in sig.parameters]
    for args, kwargs in calls:
        try:
            sig.bind(*args, **kwargs)
        except TypeError as e:
            return f"{fn.__name__}{sig} cannot be called with {len(args)} positional arguments and {kwargs}: {e}"
    return None


def test_the_contract_lists_what_kernels_exports():
    assert REQUIRED == ("FAMILY", "SOURCE", "KERNEL", "MIN_ARCH", "PARAMS", "DEFAULT", "space", "name",
                        "name_expression", "threads", "smem_bytes", "launch")
    assert not set(REQUIRED) & set(OPTIONAL)
    assert set(DATA_TYPES) == {n for n in REQUIRED + OPTIONAL if n.isupper()}


@pytest.mark.parametrize("fam", [*FAMILIES.values(), _test_family()], ids=lambda f: f.FAMILY)
def test_family_has_the_required_members_with_their_signatures(fam):
    assert isinstance(fam, KernelFamily)  # every member present
    for name in REQUIRED:
        value = getattr(fam, name)
        if name in DATA_TYPES:
            assert isinstance(value, DATA_TYPES[name]), (name, value)
        else:
            assert callable(value), name
            problem = _signature_problem(value, getattr(KernelFamily, name))
            assert problem is None, problem
    assert set(fam.DEFAULT) == set(fam.PARAMS) and fam.space().invalid_reason(fam.DEFAULT) is None
    assert isinstance(fam.launch(fam.DEFAULT), LaunchGeometry)
    assert isinstance(fam.threads(fam.DEFAULT), int) and isinstance(fam.smem_bytes(fam.DEFAULT), int)
    assert re.fullmatch(r"[A-Za-z0-9_]+", fam.name(fam.DEFAULT)) and fam.name(fam.DEFAULT, "sm80").endswith("sm80")
    if getattr(fam, "LIBRARY", ""):  # a library call: no kernel source, no template
        assert fam.SOURCE == fam.KERNEL == "" and fam.name_expression(fam.DEFAULT) == fam.LIBRARY
        assert not hasattr(fam, "TEMPLATE_ORDER") and not hasattr(fam, "estimated_registers")
    else:
        assert fam.SOURCE and fam.name_expression(fam.DEFAULT).startswith(fam.KERNEL + "<")
    assert FAMILIES.get(fam.FAMILY, fam) is fam


@pytest.mark.parametrize("fam", [*FAMILIES.values(), _test_family()], ids=lambda f: f.FAMILY)
def test_family_hooks_have_the_signatures_their_callers_use(fam):
    """Each optional member a family defines: its type, the calls the contract allows, and a real call on the
    sample problems with the values the callers expect back."""
    for name in OPTIONAL:
        if not hasattr(fam, name):
            continue
        value = getattr(fam, name)
        if name in DATA_TYPES:
            assert isinstance(value, DATA_TYPES[name]), (name, value)
        else:
            problem = _signature_problem(value, getattr(FamilyHooks, name))
            assert problem is None, problem
    space, c = fam.space(), fam.DEFAULT
    if hasattr(fam, "LEGACY"):
        assert set(fam.LEGACY) <= set(fam.PARAMS)
    if hasattr(fam, "TEMPLATE_ORDER"):
        assert set(fam.TEMPLATE_ORDER) <= set(fam.PARAMS)
    for p in PROBLEMS:
        if hasattr(fam, "applies"):
            assert fam.applies(p) is None or isinstance(fam.applies(p), str)
        if hasattr(fam, "default_for"):
            kw = {"arch": "sm_90"} if "arch" in inspect.signature(fam.default_for).parameters else {}
            for start in (fam.default_for(p, 132, **kw), fam.default_for(p, **kw)):
                assert set(start) == set(fam.PARAMS) and isinstance(space.invalid_reason(start), (str, type(None)))
        if hasattr(fam, "problem_rule"):
            assert fam.problem_rule(c, p) is None or isinstance(fam.problem_rule(c, p), str)
        for hook in ("features", "warps_in_flight", "estimated_time"):
            if hasattr(fam, hook):
                got = [getattr(fam, hook)(p, c, 132), getattr(fam, hook)(p, c)]
                assert all(isinstance(g, dict if hook == "features" else (int, float)) for g in got), got
    if hasattr(fam, "arch_rule"):
        assert all(fam.arch_rule(c, a) is None or isinstance(fam.arch_rule(c, a), str) for a in ("sm_80", "sm_90"))
    if hasattr(fam, "gpu_arch"):
        assert fam.gpu_arch(c, "sm_90").startswith("sm_90")
    if hasattr(fam, "estimated_registers"):
        assert isinstance(fam.estimated_registers(c), int)


@pytest.mark.parametrize("family", sorted(n for n, f in FAMILIES.items() if not getattr(f, "LIBRARY", "")))
def test_registered_family_has_what_the_nvcc_test_needs(family):
    fam = FAMILIES[family]
    assert hasattr(fam, "estimated_registers") and hasattr(fam, "TEMPLATE_ORDER")
    assert set(fam.TEMPLATE_ORDER) <= set(fam.PARAMS)


def test_every_family_member_the_package_looks_up_by_name_is_in_the_contract():
    """getattr/hasattr on a family in the package's code, and the tuner's ``_bound_to(family, "...")``: each
    name is a required or optional member of the contract."""
    root = Path(bagf_torch.__file__).parent
    pattern = re.compile(r'(?:getattr|hasattr|_bound_to)\((?:(?:self\.)?(?:family|fam|f)|FAMILIES\.get\(\w+\))\s*,'
                         r'\s*"(\w+)"')
    found = {}
    for path in root.rglob("*.py"):
        for name in pattern.findall(path.read_text()):
            found.setdefault(name, path.relative_to(root).as_posix())
    assert {"applies", "default_for", "problem_rule", "arch_rule", "gpu_arch", "features", "warps_in_flight",
            "LEGACY"} <= set(found)
    unknown = {n: where for n, where in found.items() if n not in REQUIRED + OPTIONAL}
    assert not unknown, f"family members looked up by name but not in bagf_torch/kernels/family.py: {unknown}"
