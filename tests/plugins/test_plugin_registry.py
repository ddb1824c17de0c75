"""The registry rules: discovery order, unique names, block list, contract checks."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from kibotos.backends import VmmBackend
from kibotos.core.errors import FailedPrecondition, InvalidArgument
from kibotos.plugins import (
    DISABLE_ENV,
    EXTRA_MODULES_ENV,
    BlockedPlugin,
    Registry,
    load_plugins,
)

BUILTINS = {
    ("placement", "binpack"): "kibotos_binpack",
    ("placement", "spread"): "kibotos_spread",
    ("storage_driver", "local"): "kibotos_local.driver",
    ("supervisor", "direct"): "kibotos_direct.supervisor",
}

GOOD_PLACEMENT = """
    from kibotos.sdk import hookimpl

    class P:
        name = "{name}"
        def __init__(self, options): pass
        def rank(self, request, candidates): return [c.node_id for c in candidates]

    @hookimpl
    def kibotos_register_placement(register):
        register(P)
"""


def test_installed_builtins_are_found_through_their_entry_points():
    regs = load_plugins()
    found = {(i.kind, i.name): i for i in regs.infos}
    for (kind, name), module in BUILTINS.items():
        info = found[(kind, name)]
        assert info.source == "builtin"
        assert info.plugin == name
        assert info.module == module
        assert info.version == md.version(f"kibotos-builtin-{name}")
        assert name in regs.registry(kind)
    eps = {ep.name: ep for ep in md.entry_points(group="kibotos")}
    for _kind, name in BUILTINS:
        assert eps[name].dist is not None
        assert eps[name].dist.name == f"kibotos-builtin-{name}"


def test_builtins_come_before_test_plugins():
    regs = load_plugins(test_modules=["plugintest_allkinds"])
    sources = [i.source for i in regs.infos]
    assert "test" in sources
    first_test = sources.index("test")
    assert all(s == "builtin" for s in sources[:first_test])
    assert all(s == "test" for s in sources[first_test:])


def test_every_hook_fills_its_registry_from_a_test_plugin(monkeypatch):
    monkeypatch.setenv(EXTRA_MODULES_ENV, "plugintest_allkinds")
    regs = load_plugins()
    assert "test-echo" in regs.vmm  # kibotos_register_vmm
    assert "test-always" in regs.storage_driver  # kibotos_register_storage_driver
    assert "test-reverse" in regs.placement  # kibotos_register_placement
    assert "test-null" in regs.supervisor  # kibotos_register_supervisor
    info = regs.info("vmm", "test-echo")
    assert (info.plugin, info.source, info.version) == ("plugintest_allkinds", "test", "test")
    assert info.module == "plugintest_allkinds"


def test_each_load_builds_its_own_manager_and_registries():
    with_test = load_plugins(test_modules=["plugintest_allkinds"])
    without = load_plugins()
    assert with_test.manager is not without.manager
    assert "test-echo" in with_test.vmm
    assert "test-echo" not in without.vmm
    assert without.manager.get_plugin("plugintest_allkinds") is None


def test_duplicate_backend_name_is_an_error_naming_both_modules(write_module):
    mod = write_module("plugintest_dup_binpack", GOOD_PLACEMENT.format(name="binpack"))
    with pytest.raises(FailedPrecondition) as err:
        load_plugins(test_modules=[mod])
    message = err.value.message
    assert "duplicate placement backend 'binpack'" in message
    assert "kibotos_binpack" in message
    assert "plugintest_dup_binpack" in message


def test_duplicate_plugin_name_is_an_error_naming_both_modules(write_module):
    # A test module whose name is an installed plugin's entry-point name.
    mod = write_module("spread", GOOD_PLACEMENT.format(name="other-spread"))
    with pytest.raises(FailedPrecondition) as err:
        load_plugins(test_modules=[mod])
    message = err.value.message
    assert "duplicate plugin 'spread'" in message
    assert "kibotos_spread (kibotos-builtin-spread)" in message
    assert f"spread ({EXTRA_MODULES_ENV})" in message


def test_block_list_from_config_keeps_a_builtin_out():
    regs = load_plugins(["spread"])
    assert "spread" not in regs.placement
    assert "binpack" in regs.placement
    assert BlockedPlugin("spread", "builtin", "kibotos_spread") in regs.blocked
    assert all(i.plugin != "spread" for i in regs.infos)


def test_block_list_from_environment_adds_to_config(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, " local , ,direct")
    regs = load_plugins(["spread"])
    assert [b.plugin for b in regs.blocked] == ["direct", "local", "spread"]
    assert "local" not in regs.storage_driver
    assert "direct" not in regs.supervisor
    assert "spread" not in regs.placement
    assert "binpack" in regs.placement


def test_blocked_plugin_is_not_even_imported(write_module, monkeypatch):
    mod = write_module("plugintest_broken", "raise ImportError('this plugin is broken')\n")
    with pytest.raises(FailedPrecondition, match=r"plugintest_broken.*failed to load.*broken"):
        load_plugins(test_modules=[mod])
    monkeypatch.setenv(DISABLE_ENV, mod)
    regs = load_plugins(test_modules=[mod])
    assert BlockedPlugin(mod, "test", mod) in regs.blocked


def test_blocking_a_name_nothing_has_is_reported_not_fatal():
    regs = load_plugins(["no-such-plugin"])
    assert BlockedPlugin("no-such-plugin", "not-installed", None) in regs.blocked
    assert "binpack" in regs.placement


def test_unknown_backend_name_lists_the_available_ones():
    # Other built-ins (qemu, nfs, …) come and go as the tree grows: expect what is there.
    regs = load_plugins()
    with pytest.raises(InvalidArgument) as err:
        regs.placement.get("first-fit")
    assert err.value.message == (
        f"unknown placement 'first-fit' (available: {', '.join(regs.placement.names())})"
    )
    assert "binpack, spread" in err.value.message
    empty = load_plugins([i.plugin for i in regs.infos if i.kind == "vmm"])
    with pytest.raises(InvalidArgument, match=r"^unknown vmm 'no-such-vmm' \(available: none\)$"):
        empty.vmm.get("no-such-vmm")
    with pytest.raises(InvalidArgument, match="unknown storage driver 'no-such-driver'"):
        regs.info("storage_driver", "no-such-driver")
    with pytest.raises(InvalidArgument, match="unknown plugin kind 'network'"):
        regs.registry("network")


def test_check_pending_refuses_a_misspelt_hook(write_module):
    mod = write_module(
        "plugintest_typo",
        """
        from kibotos.sdk import hookimpl

        @hookimpl
        def kibotos_register_vm(register):
            pass
        """,
    )
    with pytest.raises(FailedPrecondition) as err:
        load_plugins(test_modules=[mod])
    assert "plugintest_typo" in err.value.message
    assert "kibotos_register_vm" in err.value.message


def test_hookimpl_with_an_unknown_argument_is_refused(write_module):
    mod = write_module(
        "plugintest_badarg",
        """
        from kibotos.sdk import hookimpl

        @hookimpl
        def kibotos_register_placement(register, config):
            pass
        """,
    )
    with pytest.raises(FailedPrecondition, match=r"plugintest_badarg.*is invalid.*config"):
        load_plugins(test_modules=[mod])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("register(P({}))", "is not a class"),
        ("P.name = ''; register(P)", "has no name"),
        ("del P.rank; register(P)", "lacks rank"),
    ],
)
def test_registered_classes_must_meet_the_contract(write_module, body, expected):
    source = GOOD_PLACEMENT.format(name="checked").replace("register(P)", body)
    mod = write_module("plugintest_contract", source)
    with pytest.raises(FailedPrecondition, match=expected):
        load_plugins(test_modules=[mod])


class ShapedVmm:
    """A VMM backend that matches the contract's shape without subclassing it."""

    name = "shaped"

    def __init__(self, options): pass
    async def probe(self): return {}
    def unit_for(self, launch): raise NotImplementedError
    async def wait_ready(self, launch, *, timeout): return {}
    async def guest_channel(self, launch, *, timeout=10.0): raise NotImplementedError


def test_a_vmm_that_only_matches_the_shape_must_define_the_optional_members():
    with pytest.raises(FailedPrecondition) as err:
        Registry("vmm").add(ShapedVmm)
    assert err.value.message == (
        "vmm backend 'shaped' (test_plugin_registry.ShapedVmm) lacks "
        "GUEST_RETAINED_FILESYSTEMS, RUNTIME_FILES, dataplane_vsock_port, volume_devices "
        "(subclass kibotos.sdk.VmmBackend for the defaults of its optional members)")

    class Complete(ShapedVmm):
        RUNTIME_FILES = ()
        GUEST_RETAINED_FILESYSTEMS = ()
        dataplane_vsock_port = None
        def volume_devices(self, launch): return None

    Registry("vmm").add(Complete)


def test_a_vmm_that_subclasses_the_contract_inherits_the_defaults():
    class Sub(VmmBackend):
        name = "sub"
        def __init__(self, options): pass
        async def probe(self): return {}
        def unit_for(self, launch): raise NotImplementedError
        async def wait_ready(self, launch, *, timeout): return {}
        async def guest_channel(self, launch, *, timeout=10.0): raise NotImplementedError

    reg: Registry[VmmBackend] = Registry("vmm")
    reg.add(Sub)
    vmm = reg.get("sub")({})
    assert vmm.RUNTIME_FILES == ()
    assert vmm.GUEST_RETAINED_FILESYSTEMS == ("/run/kibotos/rw",)
    assert vmm.volume_devices({}) is None
    assert vmm.dataplane_vsock_port is None


def test_inheriting_a_required_method_from_the_contract_does_not_count():
    class Forgetful(VmmBackend):  # no probe: the Protocol's own stub would answer None
        name = "forgetful"
        def __init__(self, options): pass
        def unit_for(self, launch): raise NotImplementedError
        async def wait_ready(self, launch, *, timeout): return {}
        async def guest_channel(self, launch, *, timeout=10.0): raise NotImplementedError

    with pytest.raises(FailedPrecondition, match="lacks probe"):
        Registry("vmm").add(Forgetful)


def test_registry_alone_keeps_names_unique_and_sorted():
    class A:
        name = "b"
        def rank(self, request, candidates): return []

    class B:
        name = "a"
        def rank(self, request, candidates): return []

    reg: Registry[object] = Registry("placement")
    reg.add(A)
    reg.add(B)
    assert reg.names() == ["a", "b"]
    assert reg.get("b") is A
    with pytest.raises(FailedPrecondition, match="duplicate placement backend 'a'"):
        reg.add(B)


def test_an_exception_in_a_hook_names_the_plugin(write_module):
    source = GOOD_PLACEMENT.format(name="x").replace("register(P)", "raise RuntimeError('boom')")
    mod = write_module("plugintest_raises", source)
    with pytest.raises(FailedPrecondition) as err:
        load_plugins(test_modules=[mod])
    assert err.value.message == (
        "plugin 'plugintest_raises' from plugintest_raises (KIBOTOS_TEST_PLUGIN_MODULES): "
        "kibotos_register_placement failed: RuntimeError: boom"
    )
